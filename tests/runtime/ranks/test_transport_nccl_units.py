"""The NCCL transport's preconditions that need no process group: what each item of the NCCL
review fixed, checked where a CPU can see it (the twin tests, test_transport_nccl_twin.py,
run the whole path).

Each test says which finding it covers; each fails with that finding's code back in place.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from engine.runtime.ranks.transport import layout
from engine.runtime.ranks.transport.nccl import NCCLTransport


def _transport() -> NCCLTransport:
    return NCCLTransport(1, [0, 1, 2], {}, None, torch.device("cpu"), 5.0)


def test_int16_activations_are_refused_at_the_handshake() -> None:
    """ProcessGroupNCCL has no 16-bit integer type: the handshake names the leaf, the two
    stages and the dtypes NCCL carries, before anything is sent (gloo carries int16)."""
    tp = _transport()
    why = tp.unsupported({"ids": torch.zeros(2, 3, dtype=torch.int16)})
    assert "['ids'] (2, 3) torch.int16" in why and "stage 1 (rank 1)" in why and "stage 2 (rank 2)" in why
    assert "over nccl" in why and "int64" in why and "int16" not in why.split("supported dtypes are")[1]
    assert tp.unsupported({"ids": torch.zeros(2, dtype=torch.int64), "x": torch.zeros(2)}) == ""
    from engine.runtime.ranks.transport.gloo import GlooTransport

    assert GlooTransport(1, [0, 1, 2], None, torch.device("cpu"), 5.0).unsupported(
        torch.zeros(2, dtype=torch.int16)) == ""


def test_wait_never_blocks_the_host_with_a_timeout() -> None:
    """ProcessGroupNCCL's ``work.wait(timeout)`` blocks the host until the transfer is done;
    ``work.wait()`` makes the caller's stream wait. The NCCL transport's waits take no
    timeout (its control-plane waits do)."""
    calls: list[tuple[Any, ...]] = []

    class Work:
        def wait(self, *args: Any) -> bool:
            calls.append(args)
            return True

    tp = _transport()
    tp.wait(Work(), "x")
    tp.wait_host(Work(), "y")
    assert calls[0] == () and len(calls[1]) == 1


def test_bind_device_takes_local_rank_when_the_program_chose_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default group the user initialised without set_device left every rank on cuda:0
    (NCCL: "duplicate GPU"): the engine binds LOCAL_RANK's GPU, keeps a device the program
    chose, and takes the group's bound device first."""
    state = {"current": 0, "set": []}
    fake = types.SimpleNamespace(
        current_device=lambda: state["current"], device_count=lambda: 4,
        set_device=lambda d: state["set"].append(d),
    )
    monkeypatch.setattr(layout.torch, "cuda", fake)
    monkeypatch.setattr(layout, "nccl_twin", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    layout.bind_device()
    assert state["set"] == [3]
    state["current"], state["set"] = 2, []  # a deliberate set_device(2): left as it is
    layout.bind_device()
    assert state["set"] == []
    layout.bind_device(explicit=torch.device("cuda", 1))
    assert state["set"] == [torch.device("cuda", 1)]
    state["current"], state["set"] = 0, []
    monkeypatch.delenv("LOCAL_RANK")
    layout.bind_device()
    assert state["set"] == []


def test_rollback_keeps_the_rank_gpu_rng_without_stage_streams() -> None:
    """Under NCCL a rank's one stage runs on the caller's stream (no stage streams), and a
    rolled-back step must still restore that GPU's RNG state."""
    from engine.runtime.exec.protocol import StepProtocol

    fake = types.SimpleNamespace(
        device_check=None, streams=types.SimpleNamespace(cuda=False, device=None),
        rng_device=torch.device("cuda", 1),
    )
    assert StepProtocol._cuda_devices(fake) == [1]  # type: ignore[arg-type]
    fake.rng_device = torch.device("cpu")
    assert StepProtocol._cuda_devices(fake) == []  # type: ignore[arg-type]


def test_in_flight_messages_resume_on_the_transport_device() -> None:
    """An unflushed save keeps the messages in flight; a resumed rank must put them back on
    its GPU (they load on the CPU), else its next step feeds CPU tensors to CUDA stages."""
    from engine.runtime.ranks.lane import RankLane

    class Tp:
        device = torch.device("meta")

        def restore_wire_shapes(self, shapes: Any) -> None:
            pass

    lane = RankLane.__new__(RankLane)
    lane.transport = Tp()
    lane.s = 1
    lane._out_flags, lane._early, lane._outbox = {}, {}, {}
    state = {"shapes": {}, "received": [{"channel": "act", "mb": 3, "value": torch.ones(2), "grad": [False], "flag": None}],
             "outbox": [{"channel": "grad", "mb": 2, "value": (torch.ones(1), torch.ones(1)), "grad": [False, False], "flag": torch.zeros(1)}]}
    lane.load_wire_state(state)
    assert lane._early[("act", 3)].device.type == "meta"
    assert all(t.device.type == "meta" for t in lane._outbox[("grad", 2)])
    assert lane._out_flags[(1, 2)].device.type == "meta"


def test_tie_flag_travels_on_the_gradients_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tie group's all-reduce under NCCL carries device tensors only: the 'any holder used
    it' flag is made where the gradients live (it was a CPU tensor)."""
    from engine.runtime.ties import groups as ties

    seen: list[torch.device] = []

    def all_reduce(t: torch.Tensor, group: Any = None) -> None:
        seen.append(t.device)

    monkeypatch.setattr(ties.torch.distributed, "all_reduce", all_reduce)
    grad = torch.zeros(3, device="meta")
    p = types.SimpleNamespace(grad=grad, requires_grad=True)
    store = types.SimpleNamespace(settle_grads=lambda: None, was_used=lambda i: True, mark_used=lambda i: None)
    g = types.SimpleNamespace(carried=False, process_group=object(), describe=lambda: "w")
    tied = ties.TiedGradients.__new__(ties.TiedGradients)
    tied.groups, tied._local = [g], [[(store, p, 0)]]
    with pytest.raises((RuntimeError, NotImplementedError)):  # .item() of a meta tensor, after the all-reduces
        tied.reduce()
    assert seen == [torch.device("meta"), torch.device("meta")]
