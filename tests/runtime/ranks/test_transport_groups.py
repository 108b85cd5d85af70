"""The engine's own process groups and their gloo network threads (transport/groups.py).

* A pipeline of one replica runs on a group the engine creates, not on the default group: a
  message the user exchanges on the default group with the same peer and tag is not taken by
  the pipeline (gloo matches by peer and tag in posting order), and the pipeline still trains
  as the local run does.
* That group's gloo network thread runs under SCHED_BATCH; the default group's (the user's)
  keeps its policy; ``ENGINE_GLOO_BATCH=0`` keeps the default policy everywhere.
* The loss messages go through the group's own calls into two reused buffers: steps that
  switch between the verdict path and the plain loss path keep the local run's losses.

Cost: one 2-process spawn, ~5 s on 2 cores.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_support import _local, _train, batch, spawn, stage_factories
from torch import nn

from engine.runtime.ranks.transport import groups

linux_threads = pytest.mark.skipif(
    not (os.path.isdir("/proc/self/task") and hasattr(os, "SCHED_BATCH")),
    reason="thread scheduling policies are Linux's",
)


def _named_thread(name: str, ready: threading.Event, done: threading.Event, out: list[int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/self/task/<tid>/comm shows
    out.append(threading.get_native_id())
    ready.set()
    done.wait(30)


def _threads(*names: str) -> tuple[list[int], threading.Event]:
    done, tids, started = threading.Event(), [], []
    for name in names:
        ready = threading.Event()
        t = threading.Thread(target=_named_thread, args=(name, ready, done, tids), daemon=True)
        t.start()
        ready.wait(10)
        started.append(t)
    return tids, done


@linux_threads
def test_only_gloo_network_threads_are_put_under_sched_batch() -> None:
    (loop, other), done = _threads("gloo_tcp_loop", "pt_gloo_runloop")
    try:
        assert groups.network_threads({loop, other}) == [loop]
        assert groups.batch_network_threads({loop, other}) == 1
        assert os.sched_getscheduler(loop) == os.SCHED_BATCH
        assert os.sched_getscheduler(other) == os.SCHED_OTHER
    finally:
        done.set()


@linux_threads
def test_engine_gloo_batch_0_keeps_the_default_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_GLOO_BATCH", "0")
    (loop,), done = _threads("gloo_tcp_loop")
    try:
        assert groups.batch_network_threads({loop}) == 0
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER
    finally:
        done.set()


def test_a_thread_that_ended_is_skipped() -> None:
    assert groups.network_threads({2**22 + 12345}) == []  # no such task: nothing, no error
    assert groups.batch_network_threads({2**22 + 12345}) == 0


# ---------------------------------------------------------------------- two ranks


def _policies(tids: list[int]) -> list[int]:
    out = []
    for t in tids:
        try:
            out.append(os.sched_getscheduler(t))
        except OSError:
            continue
    return out


def phase_own_group(rank: int, S: int) -> dict[str, Any]:
    """Rank 1 posts a receive on the default group from rank 0 with the pipeline's data tag
    before the pipeline's first step; rank 0 answers it only after the last one."""
    from engine import Pipeline

    world_loops = groups.network_threads()  # the default group's, made before the pipeline
    kw = dict(schedule="1f1b", chunks=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    user = torch.zeros(3)
    pending = dist.irecv(user, 0, tag=0) if rank == 1 else None
    pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo",
                    timeout=30, **kw)
    losses = _train(pipe, 3)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=0)
    else:
        pending.wait()  # type: ignore[union-attr]
    _ref, ref_losses = _local(S, kw, 3)
    ours = [t for t in groups.network_threads() if t not in world_loops]
    return {
        "own_group": pipe.layout.pipeline_group is not dist.group.WORLD,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
        "user_message": user.tolist(),
        "world_policies": _policies(world_loops),
        "own_policies": _policies(ours),
    }


def phase_verdict_paths(rank: int, S: int) -> dict[str, Any]:
    """Steps whose loss travels alternately through the verdict path and the plain loss path
    (bench/step_verdict.py switches between them the same way): the loss messages' two
    receive buffers (distributed.py) are reused across both, each relayed send waited for
    once; every step's loss equals the local run's."""
    from engine import Pipeline

    kw = dict(schedule="1f1b", chunks=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo",
                    timeout=30, **kw)
    ex = pipe.parts.executor
    pattern = [True, True, False, False, False, True, False, True]
    losses = []
    for t, relay in enumerate(pattern):
        ex.rank.relay = ex.runner.aborts = relay
        losses.append(pipe.step(*batch(t)).detach().clone())
    _ref, ref_losses = _local(S, kw, len(pattern))
    return {"losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(2, [("test_transport_groups:own_group", dict(S=2)),
                     ("test_transport_groups:verdict_paths", dict(S=2))], timeout=120)


def _res(results: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    res = results[rank]
    assert res and "fatal" not in res, f"rank {rank}: {res.get('fatal', 'no result')}"
    return res["test_transport_groups:own_group"]


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_pipeline_leaves_the_default_groups_messages_alone(two_ranks: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got = _res(two_ranks, rank)
        assert got["own_group"], rank
        assert got["losses_equal"], rank
    assert _res(two_ranks, 1)["user_message"] == [1.0, 2.0, 3.0]


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@linux_threads
def test_only_the_engines_network_thread_runs_under_sched_batch(two_ranks: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got = _res(two_ranks, rank)
        assert got["world_policies"] and set(got["world_policies"]) == {os.SCHED_OTHER}, (rank, got)
        assert got["own_policies"] and set(got["own_policies"]) == {os.SCHED_BATCH}, (rank, got)


def test_group_calls_refuse_after_the_group_was_released() -> None:
    calls = groups.GroupCalls(object())
    calls.forget()
    with pytest.raises(RuntimeError, match="released at exit"):
        calls.send(torch.zeros(1), 0, 0)  # not silently on the default group


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_steps_switching_between_the_verdict_and_the_loss_path(two_ranks: list[dict[str, Any]]) -> None:
    for rank in range(2):
        res = two_ranks[rank]
        assert res and "fatal" not in res, f"rank {rank}: {res.get('fatal', 'no result')}"
        assert res["test_transport_groups:verdict_paths"]["losses_equal"], rank
