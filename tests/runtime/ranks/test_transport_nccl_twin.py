"""The NCCL transport, run on CPU through the NCCL twin (engine.testing.nccl_twin): a backend
that enforces NCCL's rules at their worst -- one in-order queue per communicator, sends that
complete only when their receive runs, no tags -- so the default test run executes the NCCL
code path (transport/nccl.py) and finds the hangs a GPU cluster would.

What it checks, against the local run of the same configuration (bit for bit where gloo is):

* every schedule family and mitigation at 2 and 4 ranks, interleaved and the V placements
  (zbv, dualpipev, looped BFS, contiguous blocks, vmin, vhalf), data parallelism 2 x 2,
  tensor x pipeline parallelism on a mesh, tied weights, trees, evaluate(), float16/bfloat16,
  clipping, skip_update flags, variable shapes (input-driven and data-driven), save/load
  flushed and unflushed, and a rank whose stage raises (synchronous: every rank rolls back;
  asynchronous: every rank raises, none waits);
* the findings of the NCCL review, each by a check that fails with its code back: one
  communicator for both directions of a boundary deadlocks 1F1B (reported as a deadlock on
  both ranks) where the engine's direction communicators complete; no host read per
  activation (the count per step does not grow with the micro-batches); nothing stays
  pending across a step boundary (a pause longer than the groups' timeout between
  asynchronous steps is harmless); int16 activations refused at the handshake.

The engine-initialised path (``ENGINE_NCCL_TWIN=1 torchrun ...``) is
test_transport_nccl_torchrun.py. Cost: two spawns of 2 and 4 processes and two small ones,
~1-3 min on 2 cores.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_support import _sgd, batch, configs, spawn, stage_factories
from torch import nn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

SKIP_UPDATE = ["pb", "pb-k2", "pb-lwp", "pb-pipemare-t2", "pb-spectrain-reuse", "pipedream", "2bw"]
VARLEN = ["gpipe-tied", "1f1b-tied", "pipedream", "pb"]
RESUME = ["pipedream", "2bw", "pb-k2", "pb-spectrain-reuse", "tree-pipedream", "tree-pb-k2",
          "nan-pb", "nan-2bw"]
TP_SYNC = ["gpipe", "1f1b", "1f1b-adam", "gpipe-clip", "split-1f1b"]
TP_ASYNC = ["pb-lwp", "pipedream", "split-pb-lwp", "pb-clip"]
HERE = "test_transport_nccl_twin"


# ---------------------------------------------------------------------- NCCL-only phases


def phase_host_reads(rank: int, S: int) -> dict[str, Any]:
    """Host reads (ops that wait for the device on a GPU: .item(), bool(t), host copies)
    during one steady step with static shapes, at M = 4 and M = 8 micro-batches: the
    count is the step's (the loss, the verdict), not one per activation."""
    from engine import Pipeline
    from engine.runtime.capture.dispatch_trace import Recorder

    out: dict[str, Any] = {}
    for name in ("1f1b", "pb"):
        counts = {}
        for M in (4, 8):
            pipe = Pipeline(stage_factories(S), schedule=name, chunks=M, optimizer=_sgd(),
                            loss_fn=nn.functional.mse_loss, transport="nccl", timeout=30)
            for t in range(2):  # the handshake and a first step
                pipe.step(*batch(t, 2 * M))
            rec = Recorder()
            with rec:
                pipe.step(*batch(2, 2 * M))
            counts[M] = [op.where for op in rec.ops if op.sync is not None]
            pipe.flush()
        out[name] = counts
    return out


def phase_shared_channels(rank: int, S: int) -> dict[str, Any]:
    """The review's first (and twelfth) finding, replayed: both directions of a boundary on
    ONE communicator (what one batch_isend_irecv per op on the pipeline group, or one group
    per boundary of virtual stages, amounted to). gpipe still completes (all forwards'
    sends, then all backwards'); 1F1B and interleaved 1F1B deadlock at their first
    steady-state exchange. Terminal: the deadlocked communicators are aborted."""
    from engine import Pipeline
    from engine.runtime.ranks.transport import layout

    real = layout.pipeline_groups

    def shared(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        control, channels = real(*args, **kwargs)
        return control, {(c, b): channels[("act", b)] for c, b in channels}

    from engine.runtime.ranks import virtual

    real_new = virtual.new_group
    made: dict[tuple[int, ...], Any] = {}

    def one_per_boundary(pair: list[int], **kw: Any) -> Any:  # both directions: one group
        # (virtual_transports asks for "act" then "grad" of a boundary, back to back)
        key = tuple(pair)
        group = made.pop(key, None)
        if group is None:
            group = made[key] = real_new(pair, **kw)
        return group

    layout.pipeline_groups = shared  # type: ignore[assignment]
    virtual.new_group = one_per_boundary  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        for name in ("gpipe", "1f1b", "interleaved"):
            extra = dict(virtual_stages=2) if name == "interleaved" else {}
            factories = stage_factories(2 * S if extra else S)
            pipe = Pipeline(factories, schedule=name, chunks=4, optimizer=_sgd(), **extra,
                            loss_fn=nn.functional.mse_loss, transport="nccl", timeout=60)
            t0 = time.perf_counter()
            try:
                for t in range(2):
                    pipe.step(*batch(t))
                out[name] = {"type": None}
            except Exception as exc:
                out[name] = {"type": type(exc).__name__, "message": str(exc),
                             "seconds": time.perf_counter() - t0}
                time.sleep(2.0)  # stay up: a peer sees the report, not this rank leaving
    finally:
        layout.pipeline_groups = real  # type: ignore[assignment]
        virtual.new_group = real_new  # type: ignore[assignment]
    return out


def phase_pause(rank: int, S: int, pause: float, timeout: float) -> dict[str, Any]:
    """Asynchronous steps, then a pause longer than every group's timeout (the pipeline's
    ``timeout``; NCCL's watchdog counts from enqueue), then more steps: nothing was left
    pending across the boundary, so the run goes on and equals the local one."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    for name in ("pb", "pipedream"):
        kw = dict(configs(S)[name])
        try:
            pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="nccl",
                            timeout=timeout, **kw)
            ref = Pipeline([f() for f in stage_factories(S)], loss_fn=nn.functional.mse_loss, **kw)
            same = True
            for t in range(4):
                if t == 2:
                    time.sleep(pause)
                x, y = batch(t)
                same &= torch.equal(pipe.step(x, y), ref.step(x, y))
            pipe.flush()
            ref.flush()
            s = pipe.layout.stage
            out[name] = {"losses_equal": same, "weights_equal": all(
                torch.equal(a, b) for a, b in zip(pipe.stages[0].module.parameters(),
                                                  ref.stages[s].module.parameters(), strict=True))}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def phase_data_shapes(rank: int, S: int) -> dict[str, Any]:
    """activation_shapes="inputs" (the default) with a stage whose output length depends on
    the data: a clear error naming the stage and the option, on every rank, before any weight
    changes (a synchronous step rolls back); afterwards batches whose shapes follow from the
    inputs train as the local run does."""
    from distributed_support import varlen_batch, varlen_stages

    from engine import Pipeline

    kw = dict(schedule="gpipe", chunks=4, loss_fn=nn.functional.cross_entropy, optimizer=_sgd())
    pipe = Pipeline(varlen_stages(S, False), transport="nccl", timeout=30, **kw)
    ref = Pipeline(varlen_stages(S, False), **kw)

    def full(t: int) -> Any:  # every sample as long as the batch: nothing is trimmed
        x, y = varlen_batch(t)
        return {"ids": x["ids"], "mask": torch.ones_like(x["mask"])}, y

    x, y = full(0)
    torch.equal(pipe.step(x, y), ref.step(x, y))
    before = [p.detach().clone() for p in pipe.stages[0].module.parameters()]
    out: dict[str, Any] = {}
    try:
        pipe.step(*varlen_batch(1))
        out["type"] = None
    except Exception as exc:
        out |= {"type": type(exc).__name__, "message": str(exc)}
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(
        before, pipe.stages[0].module.parameters(), strict=True))
    same = True
    for t in (2, 3):
        x, y = full(t)
        same &= torch.equal(pipe.step(x, y), ref.step(x, y))
    s = pipe.layout.stage
    out["then_equal"] = same and all(torch.equal(a, b) for a, b in zip(
        pipe.stages[0].module.parameters(), ref.stages[s].module.parameters(), strict=True))
    return out


def phase_async_failure(rank: int, S: int, victim: int) -> dict[str, Any]:
    """A stage raises inside an asynchronous (pb) step: under NCCL its micro-batch cannot be
    dropped on the other ranks, so the victim finishes the step's communication with zeros
    and every rank raises at the step's end -- the victim the user's error, the others a
    PeerStepError saying so -- within seconds, none left waiting. The pipeline is closed on
    every rank: a later step, flush or save raises at once, saying to rebuild and load."""
    import engine
    from failure_dist_support import _boom_pipe

    pipe = _boom_pipe(S, "pb", "forward", transport="nccl", timeout=30)
    out: dict[str, Any] = {"type": None}
    for t in range(4):
        module = pipe.stages[0].module
        if t == 2 and rank == victim:
            module.armed = module.once = True
        t0 = time.perf_counter()
        try:
            pipe.step(*batch(t))
        except Exception as exc:
            out = {"type": type(exc).__name__, "message": str(exc), "step": t,
                   "seconds": time.perf_counter() - t0}
            break
    later = []
    for call in (lambda: pipe.step(*batch(5)), pipe.flush,
                 lambda: engine.save(pipe, os.path.join(tempfile.mkdtemp(), "ck"))):
        try:
            call()
            later.append(None)
        except Exception as exc:
            later.append(f"{type(exc).__name__}: {exc}")
    out["later"] = later
    return out


def phase_int16(rank: int, S: int) -> dict[str, Any]:
    """A stage whose output is int16, which ProcessGroupNCCL cannot carry: refused at the
    handshake on every rank, naming the leaf and both stages, before anything is sent."""
    from engine import Pipeline

    class Ids(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> Any:
            return self.lin(x), (x > 0).to(torch.int16)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(h * ids.float())

    pipe = Pipeline([Ids, Head], schedule="gpipe", chunks=2, optimizer=_sgd(),
                    loss_fn=nn.functional.mse_loss, transport="nccl", timeout=30)
    try:
        pipe.step(*batch(0))
        return {"type": None}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}


def phase_communicators(rank: int, S: int, root: str) -> dict[str, Any]:
    """Which NCCL communicators a pipeline's life makes (build, handshake, steps of a
    synchronous and an asynchronous schedule, evaluate, save and load): group ones only.
    ProcessGroupNCCL makes a two-rank communicator for every pair an unbatched send/recv
    joins (what the handshake, evaluate and the placements used to post); each holds its
    own device memory. Also: cuda_graphs="optimizer" with an asynchronous schedule under
    NCCL is refused before anything is built (capturing synchronises the device mid-step)."""
    import engine
    import engine.testing.nccl_twin as twin
    from engine import Pipeline

    for name in ("1f1b", "pb"):
        kw = dict(configs(S)["pb" if name == "pb" else "gpipe"], schedule=name)
        pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="nccl",
                        timeout=30, **kw)
        for t in range(2):
            pipe.step(*batch(t))
        pipe.flush()
        pipe.evaluate(batch(9)[0])
        engine.save(pipe, os.path.join(root, name))
        engine.load(pipe, os.path.join(root, name))
    hub = twin._hub
    assert hub is not None
    out: dict[str, Any] = {"communicators": sorted(hub.comms)}
    try:
        Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="nccl", timeout=30,
                 cuda_graphs="optimizer", **configs(S)["pb"])
        out["graphs"] = None
    except Exception as exc:
        out["graphs"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------- the spawns


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="engine-nccl2-")
    # a short deadlock limit for the shared-channels phase (the twin reads it at its start;
    # only a real deadlock, every rank waiting in the twin, trips it)
    old = os.environ.get("ENGINE_NCCL_TWIN_DEADLOCK_S")
    os.environ["ENGINE_NCCL_TWIN_DEADLOCK_S"] = "3"
    try:
        return _spawn_two(root)
    finally:
        if old is None:
            os.environ.pop("ENGINE_NCCL_TWIN_DEADLOCK_S", None)
        else:
            os.environ["ENGINE_NCCL_TWIN_DEADLOCK_S"] = old


def _spawn_two(root: str) -> list[dict[str, Any]]:
    return spawn(2, [
        ("equal", dict(S=2, names=None)),
        ("handshake_mismatch", dict(S=2)),
        ("varlen", dict(S=2, names=VARLEN, activation_shapes="any")),
        ("distributed_support.phase_varlen", dict(S=2, names=VARLEN, trim=False)),
        ("interleaved", dict(R=2)),
        ("reject_input", dict(S=2)),
        ("skip_update", dict(S=2, names=[*SKIP_UPDATE, "first-pb"])),
        ("evaluate", dict(S=2)),
        ("ties", dict(S=2)),
        ("trees", dict(S=2)),
        ("balance", dict(S=2)),
        ("checkpoint", dict(S=2, root=root, names=["1f1b-adam", "pb-lwp-momentum"])),
        (f"{HERE}:host_reads", dict(S=2)),
        (f"{HERE}:communicators", dict(S=2, root=os.path.join(root, "comm"))),
        (f"{HERE}:data_shapes", dict(S=2)),
        (f"{HERE}:int16", dict(S=2)),
        (f"{HERE}:async_failure", dict(S=2, victim=1)),
        (f"{HERE}:shared_channels", dict(S=2)),  # terminal: its communicators are aborted
    ], timeout=600, transport="nccl")


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="engine-nccl4-")
    return spawn(4, [
        ("equal", dict(S=4, names=None)),
        ("interleaved", dict(R=4)),
        ("skip_update", dict(S=4, names=SKIP_UPDATE)),
        ("varlen", dict(S=4, names=["1f1b-tied", "pb"], activation_shapes="any")),
        ("data_parallel", dict(S=2, R=2)),
        ("features_dist_support:clip", dict(S=4)),
        ("features_dist_support:amp", dict(S=4)),
        ("tp_support.phase_tp_train", dict(shape=(2, 1, 2), names=TP_SYNC + TP_ASYNC)),
        ("resume_inflight", dict(S=4, names=RESUME, k=3, steps=6, root=root,
                                 dir_names=("2bw", "pb-k2", "tree-pb-k2", "nan-2bw"))),
        ("failure_dist_support:stage_recover", dict(
            S=4, names=["1f1b-adam", "gpipe"],
            cases=[[2, "backward"], [1, "forward"], [0, "last-backward"]])),
        (f"{HERE}:async_failure", dict(S=4, victim=2)),
    ], timeout=900, transport="nccl")


def _ok(results: list[dict[str, Any]], phase: str) -> list[Any]:
    out = []
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        assert phase in res, f"rank {rank} never reached {phase}"
        out.append(res[phase])
    return out


def _no_errors(got: dict[str, Any], rank: int) -> None:
    for name, r in got.items():
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank} ({name}): {r['error']}"


# ---------------------------------------------------------------------- every family


@pytest.mark.parametrize("name", sorted(configs(2)))
def test_two_ranks_bitwise_equal_local(two: list[dict[str, Any]], name: str) -> None:
    from test_distributed_gloo import _check_equal

    _check_equal(two, name)


@pytest.mark.parametrize("name", sorted(configs(4)))
def test_four_ranks_bitwise_equal_local(four: list[dict[str, Any]], name: str) -> None:
    from test_distributed_gloo import _check_equal

    _check_equal(four, name)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_equals_local(two: list[dict[str, Any]], four: list[dict[str, Any]], world: int) -> None:
    for rank, got in enumerate(_ok(two if world == 2 else four, "interleaved")):
        for name in ("mlp", "varlen-tied"):
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == [rank, rank + world] and r["updates"] == [2, 2], (rank, name, r)
            assert r["weights_equal"] and r["losses_equal"] and r["leftovers"] == 0, (rank, name, r)
        assert got["mlp"]["resumed_equal"] and got["mlp"]["evaluate_equal"], got["mlp"]
        assert got["reject"].get("type") == "PipelineInputError", got["reject"]
        assert got["reject"]["unchanged"] and got["reject"]["then_equal"], got["reject"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", SKIP_UPDATE)
def test_skip_update_flags_travel_on_the_device(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int, name: str
) -> None:
    from test_distributed_gloo import _check_skip_update

    _check_skip_update(two if world == 2 else four, "skip_update", name)


def test_data_parallel_two_by_two(four: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(_ok(four, "data_parallel")):
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["replica"] == rank // 2 and r["moved"] > 1e-3, (name, r)
            assert r["max_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (rank, name, r)


def test_tensor_times_pipeline_parallel_on_a_mesh(four: list[dict[str, Any]]) -> None:
    """pp=2 x tp=2 (DTensor collectives over the twin): equal to the unsharded model (the
    synchronous schedules) or to the same schedule without TP, within the sharded matmuls'
    reordering (1e-6, as under gloo)."""
    for rank, got in enumerate(_ok(four, "tp_support.phase_tp_train")):
        for name in TP_SYNC + TP_ASYNC:
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('tb')}"
            assert r["tp"] == 2 and r["moved"] > 1e-3 and r["max_diff"] < 1e-6, (rank, name, r)


@pytest.mark.parametrize("phase", ["features_dist_support:clip", "features_dist_support:amp"])
def test_clipping_and_mixed_precision(four: list[dict[str, Any]], phase: str) -> None:
    for rank, got in enumerate(_ok(four, phase)):
        _no_errors(got, rank)
        for name, r in got.items():
            assert r["weights_equal"] and r["losses_equal"], (rank, name, r)


@pytest.mark.parametrize("phase", ["evaluate", "ties", "trees", "balance"])
def test_evaluate_ties_trees_balance(two: list[dict[str, Any]], phase: str) -> None:
    for rank, got in enumerate(_ok(two, phase)):
        if phase == "evaluate":
            assert "error" not in got and got["outputs_equal"] and got["weights_equal"], got
        elif phase == "balance":
            assert got["equal"] and got["losses_equal"], got
        else:
            _no_errors(got, rank)
            for name, r in got.items():
                assert r["weights_equal"] and r["losses_equal"], (rank, phase, name, r)


# ---------------------------------------------------------------------- shapes


def test_variable_shapes_from_the_data(two: list[dict[str, Any]], four: list[dict[str, Any]]) -> None:
    """activation_shapes="any": micro-batches trimmed by their data, each activation's
    shapes first as a host message on the control plane; bit for bit, tied weights too."""
    for results in (two, four):
        for rank, got in enumerate(_ok(results, "varlen")):
            expected = got.pop("expected_changes")
            assert expected > 4
            for name, r in got.items():
                assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
                assert r["weights_equal"] and r["losses_equal"] and r["leftovers"] == 0, (rank, name, r)
                assert r["shape_changes"] == (expected if rank < len(results) - 1 else 0), (rank, name, r)


def test_variable_shapes_from_the_inputs_need_no_message_per_activation(
    two: list[dict[str, Any]],
) -> None:
    """activation_shapes="inputs" (the default), the sequence length changing between
    steps: the first stage's notice flags the micro-batches whose input shapes change, only
    their activations carry a header, and the run equals the local one bit for bit."""
    for rank, got in enumerate(_ok(two, "distributed_support.phase_varlen")):
        expected = got.pop("expected_changes")
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["weights_equal"] and r["losses_equal"] and r["leftovers"] == 0, (rank, name, r)
            assert r["shape_changes"] == (expected if rank == 0 else 0), (rank, name, r)
            assert r["notices"] == 4, (rank, name, r)  # one per step, on every rank


def test_data_dependent_shapes_are_refused_under_inputs_mode(two: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(_ok(two, f"{HERE}:data_shapes")):
        if rank == 0:
            assert got["type"] == "PipelineInputError", got
            assert "stage 0 (rank 0)'s output for micro-batch" in got["message"], got
            assert "activation_shapes='any'" in got["message"], got
        else:
            assert got["type"] == "PeerStepError" and "rolled the step back" in got["message"], got
        assert got["unchanged"] and got["then_equal"], got


def test_input_a_stage_cannot_accept_stops_every_rank_before_the_step(
    two: list[dict[str, Any]],
) -> None:
    for got in _ok(two, "reject_input"):
        assert got["type"] == "PipelineInputError", got
        assert "stage 0 (rank 0) cannot accept it" in got["message"], got
        assert got["unchanged"] and got["updates"] == 1, got


def test_handshake_mismatch_names_both_ranks(two: list[dict[str, Any]]) -> None:
    for got in _ok(two, "handshake_mismatch"):
        assert got["type"] == "PipelineInputError" and "stage 1 (rank 1)" in got["message"], got
        assert got["unchanged"], got


def test_int16_is_refused_at_the_handshake(two: list[dict[str, Any]]) -> None:
    for got in _ok(two, f"{HERE}:int16"):
        assert got["type"] == "PipelineInputError", got
        assert "int16" in got["message"] and "over nccl" in got["message"], got
        assert "stage 0 (rank 0)" in got["message"] and "stage 1 (rank 1)" in got["message"], got


# ---------------------------------------------------------------------- saving, failures


def test_save_load_flushed(two: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(_ok(two, "checkpoint")):
        for name in ("1f1b-adam", "pb-lwp-momentum"):
            r = got[name]
            assert r["weights_equal"] and r["losses_equal"] and r["optimizer_equal"], (rank, name, r)


@pytest.mark.parametrize("name", RESUME)
def test_resume_unflushed_is_bitwise(four: list[dict[str, Any]], name: str) -> None:
    """An unflushed save at a step boundary holds the messages in flight (received at the
    step's end under NCCL: nothing is left on the wire), and a fresh rank resumes them on its
    device: the run continues bit for bit."""
    for rank, got in enumerate(_ok(four, "resume_inflight")):
        r = got[name]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["in_flight"] and r["losses_equal"] and r["state_equal"], (rank, r)


def test_synchronous_stage_failure_rolls_back_every_rank(four: list[dict[str, Any]]) -> None:
    """A user stage raises inside a synchronous step: the failing rank completes its
    communication with zeros, the step's verdict tells every rank, all roll back; the retried
    run equals the local run's same recovery bit for bit."""
    from test_distributed_failures import _check_stage_recover

    _check_stage_recover(four)


@pytest.mark.parametrize("world", [2, 4])
def test_asynchronous_stage_failure_raises_everywhere_without_a_hang(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int
) -> None:
    victim = 1 if world == 2 else 2
    for rank, got in enumerate(_ok(two if world == 2 else four, f"{HERE}:async_failure")):
        assert got["step"] == 2 and got["seconds"] < 10, (rank, got)
        for said in got["later"]:  # step, flush, save: refused at once, saying what to do
            assert said is not None and "Build the pipeline again" in said, (rank, got["later"])
        if rank == victim:
            assert got["type"] == "ValueError" and "user's forward" in got["message"], got
        else:
            assert got["type"] == "PeerStepError", (rank, got)
            assert "asynchronous step" in got["message"] and "Restore the last checkpoint" in got["message"], got
            assert f"rank {victim}" in got["message"], got


# ---------------------------------------------------------------------- NCCL's rules


def test_one_communicator_for_both_directions_deadlocks_and_is_reported(
    two: list[dict[str, Any]],
) -> None:
    """The can-fail twin of the direction communicators: with act and grad of a boundary on
    one communicator, 1F1B stops with a deadlock report on both ranks naming each rank's
    head op (labelled with the message it carries); gpipe completes."""
    for got in _ok(two, f"{HERE}:shared_channels"):
        assert got["gpipe"]["type"] is None, got["gpipe"]
        for name in ("1f1b", "interleaved"):
            r = got[name]
            assert r["type"] == "PeerError" and "deadlock" in r["message"], (name, r)
            assert "mb " in r["message"] and "stage" in r["message"], (name, r)
            assert r["seconds"] < 30, (name, r)


def test_no_host_read_per_activation(two: list[dict[str, Any]]) -> None:
    """The step's host reads (the loss, its verdict) do not grow with the number of
    micro-batches: none per activation (the review's fourth finding: one per activation)."""
    for rank, got in enumerate(_ok(two, f"{HERE}:host_reads")):
        for name, counts in got.items():
            assert len(counts[4]) == len(counts[8]) <= 2, (rank, name, counts)


def test_only_group_communicators_and_no_optimizer_capture_mid_step(
    two: list[dict[str, Any]],
) -> None:
    """No unbatched point-to-point op anywhere (each would make a two-rank communicator,
    "group/low:high" in the twin's names); the optimizer capture refusal names the fix."""
    for rank, got in enumerate(_ok(two, f"{HERE}:communicators")):
        pairs = [c for c in got["communicators"] if ":" in c]
        assert pairs == [] and got["communicators"], (rank, got["communicators"])
        said = got["graphs"]
        assert said is not None and said.startswith("PipelineConfigError"), said
        assert "cuda_graphs='optimizer'" in said and "asynchronous" in said, said


def test_nothing_pending_across_a_step_boundary() -> None:
    """Groups whose timeout (NCCL's watchdog, from enqueue) is shorter than a pause between
    asynchronous steps: the sends a step leaves for the next one were received at its end."""
    results = spawn(2, [(f"{HERE}:pause", dict(S=2, pause=6.0, timeout=4.0))], timeout=240,
                    transport="nccl", init_timeout=4.0)
    for rank, got in enumerate(_ok(results, f"{HERE}:pause")):
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r['error']}"
            assert r["losses_equal"] and r["weights_equal"], (rank, name, r)


def test_vmin_vhalf_and_v_placements_over_the_twin(tmp_path: Any) -> None:
    """zbv, dualpipev, looped BFS, contiguous blocks and the CSVs torch's schedules dump, at 2
    ranks; their checks are the gloo test's."""
    from test_schedule_gloo_programs import CLASSES, _v, torch_schedule

    R = 2
    csvs = {}
    for kind in CLASSES:
        path = tmp_path / f"{kind}.csv"
        torch_schedule(kind, R, 2 * R)._dump_csv(str(path), format="compute_comms")
        csvs[f"torch_{kind}"] = path.read_text()
    results = spawn(R, [("rank_programs", dict(R=R, csvs=csvs)),
                        ("test_schedule_vblocks_runtime:vblocks", dict(R=R, transport="nccl"))],
                    timeout=600, transport="nccl")
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name, r in res["rank_programs"].items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["losses_equal"] and r["weights_equal"], (rank, name, r)
        for name in ("zbv", "dualpipev"):
            assert res["rank_programs"][name]["stages"] == _v(rank, R)
        for name, r in res["test_schedule_vblocks_runtime:vblocks"].items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["losses_equal"] and r["weights_equal"], (rank, name, r)
