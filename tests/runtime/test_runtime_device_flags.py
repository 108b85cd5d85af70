"""on_nonfinite="skip_update": asynchronous schedules flag non-finite losses on the device and
skip the updates that hold them via the optimizer's found_inf, with no host read per
micro-batch (engine/runtime/stage/device_flags.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_support import DEVICE, needs_kernels
from stream_twin import StreamTwin, twin_factory
from test_runtime_errors import _same, _snapshot
from torch import nn

import engine
from engine import Pipeline
from engine.errors import PipelineConfigError
from engine.runtime.stage.device_flags import check_skip_update

mse = nn.functional.mse_loss
RUNTIME = str(Path(engine.__file__).parent / "runtime")


def _stages(S: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(S - 1)]
    return out + [nn.Linear(4, 1)]


def sgd(p):
    return engine.optim.SGD(p, lr=0.1, momentum=0.9)


def adam(p):
    return engine.optim.Adam(p, lr=0.01)


def _pipe(schedule: str, mode: str, optimizer=sgd, S: int = 3, **kw) -> Pipeline:
    return Pipeline(
        [m.to(DEVICE) for m in _stages(S)], schedule=schedule, chunks=4, loss_fn=mse,
        optimizer=optimizer, on_nonfinite=mode, **kw,
    )


def _batches(nan_at: dict[int, list[int]] | None = None, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n mini-batches of 4 micro-batches (2 samples each); ``nan_at[step]`` lists the
    micro-batches of that step whose target (so loss) is NaN."""
    g = torch.Generator().manual_seed(2)
    out = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]
    for step, mbs in (nan_at or {}).items():
        for m in mbs:
            out[step][1][2 * m] = float("nan")
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in out]


def _run(pipes: list[Pipeline], data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Step every pipeline through ``data``, then flush them."""
    for x, y in data:
        for p in pipes:
            p.step(x, y)
    for p in pipes:
        p.flush()


def _counters(pipe: Pipeline) -> tuple[int, list[int], list[int]]:
    st = pipe.stats()
    return st["dropped_microbatches"], st["skipped_updates"], st["updates"]


def _clean_after(pipe: Pipeline) -> None:
    """Gradient buffers (the arena's flat ones) are zero after the last update, and the
    weights are finite: the NaN gradients of the skipped updates were cleared with them.
    (Zero as they count: a GPU stage leaves them stale for the next backward to write,
    fresh_grads.py, and so does every stage's found_inf; grad_state/state read them so.)"""
    assert pipe.flushed
    for st in pipe.stages:
        assert all(not g.any() for g in st.store.grad_state())
        assert all(torch.isfinite(p).all() for p in st.module.parameters())
        assert not st.bridge.skip.state().any()


def _watch_updates(pipe: Pipeline) -> list[tuple[int, int, bool, bool, bool]]:
    """Per update, as (stage, update, ...): whether it was flagged, whether its gradient
    buffers held a non-finite value before it, and whether they were zero after it."""
    seen = []
    for st in pipe.stages:
        def update(*args, st=st, orig=st.update, **kwargs):
            flagged = bool(st.bridge.skip.state())
            bad = any(not torch.isfinite(g).all() for g in st.store.grad_state())
            u = st.updates
            orig(*args, **kwargs)
            seen.append((st.index, u, flagged, bad, all(not g.any() for g in st.store.grad_state())))
        st.update = update
    return seen


@pytest.mark.parametrize("optimizer", [sgd, adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("schedule", ["pb", "pipedream"])
def test_groups_of_one_equal_dropping_the_microbatch(schedule: str, optimizer) -> None:
    """Update groups of one micro-batch: skipping the update that holds it is dropping it.
    Bitwise equal to "skip" (which reads every loss on the host), counters equal after
    every step."""
    data = _batches({1: [1], 2: [0, 3]})
    a = _pipe(schedule, "skip_update", optimizer)
    b = _pipe(schedule, "skip", optimizer)
    assert a.spec.update_size == 1
    for k, (x, y) in enumerate(data):
        loss = a.step(x, y)
        torch.testing.assert_close(loss, b.step(x, y), rtol=0, atol=0, equal_nan=True)
        assert bool(torch.isfinite(loss)) == (k in (0, 3))  # how a run stops on it
        assert _counters(a) == _counters(b)
    a.flush()
    b.flush()
    assert _counters(a) == _counters(b) and _counters(a)[0] == 3
    assert _same(_snapshot(a), _snapshot(b))
    _clean_after(a)


def test_larger_group_is_skipped_whole() -> None:
    """2BW, groups of 4: one NaN micro-batch skips its group's update at every stage (AMP's
    semantics) -- bitwise the run in which every micro-batch of that group was dropped --
    and the next update is clean. The accumulator is one tensor object for the whole run."""
    a = _pipe("2bw", "skip_update", adam)
    b = _pipe("2bw", "skip", adam)
    assert a.spec.update_size == 4
    accs = [st.bridge.skip.found_inf for st in a.stages]
    seen = _watch_updates(a)
    for (x, y), (xb, yb) in zip(_batches({1: [2]}), _batches({1: [0, 1, 2, 3]}), strict=True):
        a.step(x, y)
        b.step(xb, yb)
    a.flush()
    b.flush()
    assert _same(_snapshot(a), _snapshot(b))
    # update 1 of every stage: flagged, its NaN gradients in the flat buffers (the flagged
    # backward ran), zeroed by the skipped update like by any other
    assert sorted(seen) == [(s, u, u == 1, u == 1, True) for s in range(3) for u in range(4)]
    dropped, skipped, updates = _counters(a)
    assert dropped == 1 and skipped == [1, 1, 1] and len(set(updates)) == 1
    assert _counters(b)[1] == [1, 1, 1]  # "skip": the group had nothing left to apply
    _clean_after(a)
    assert [st.bridge.skip.found_inf for st in a.stages] == accs
    # and it differs from "skip" with the same single NaN: that renormalises the other three
    c = _pipe("2bw", "skip", adam)
    _run([c], _batches({1: [2]}))
    assert not _same(_snapshot(a), _snapshot(c))


@pytest.mark.parametrize(
    ("opt_kw", "pipe_kw"),
    [
        (dict(prediction="linear"), {}),
        (dict(prediction="linear"), dict(weight_prediction="spectrain_reuse")),
        (dict(discrepancy_correction=True), {}),
    ],
    ids=["lwp", "spectrain_reuse", "pipemare_t2"],
)
def test_computed_weights_after_a_skipped_update(opt_kw: dict, pipe_kw: dict) -> None:
    """pb with a weight mitigation: a skipped step writes no prediction, so the next forward
    predicts from the (unchanged) weights and state; PipeMare's delta is state the skip
    keeps -- bitwise what "skip" gives."""
    def make(p):
        return engine.optim.SGD(p, lr=0.1, momentum=0.9, **opt_kw)

    # checkpoint="never": with LWP each backward copies the live weights into the transient
    # the forwards read (engine/runtime/stage/stage.py, rebase), so a stale transient shows
    a = _pipe("pb", "skip_update", make, checkpoint="never", **pipe_kw)
    b = _pipe("pb", "skip", make, checkpoint="never", **pipe_kw)
    _run([a, b], _batches({1: [1, 2]}))
    assert _same(_snapshot(a), _snapshot(b))
    _clean_after(a)


def test_no_host_read_per_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in engine/runtime reads a tensor on the host during the steps ("skip" reads
    each loss: the counter sees those); stats() folds the counters in one read."""
    reads: list[str] = []

    def spy(name: str):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(RUNTIME) or caller == __file__:
                reads.append(f"{name} from {Path(caller).name}")
            return orig(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)

    import math

    real_isfinite = math.isfinite

    def isfinite(v):  # float(tensor) inside math.isfinite is a host read too
        if isinstance(v, torch.Tensor):
            reads.append("math.isfinite")
        return real_isfinite(v)

    data = _batches({1: [1]})
    pipes = {m: _pipe("pb", m) for m in ("skip_update", "skip")}
    for p in pipes.values():  # the first step validates shapes (a dry run): not steady state
        p.step(*data[0])
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        spy(name)
    monkeypatch.setattr(math, "isfinite", isfinite)
    for x, y in data[1:]:
        pipes["skip_update"].step(x, y)
    assert reads == []
    pipes["skip_update"].stats()
    assert reads == ["tolist from device_flags.py"]
    reads.clear()
    for x, y in data[1:]:
        pipes["skip"].step(x, y)
    assert len(reads) >= 3 * 4  # one per micro-batch: what the device flags avoid


@needs_kernels
def test_fused_kernels_skip_on_the_device() -> None:
    """fused=True (Triton; interpreted on CPU): the kernels take the accumulator as found_inf."""
    def fused(p):
        return engine.optim.Adam(p, lr=0.01, fused=True)

    a = _pipe("pb", "skip_update", fused, S=2)
    b = _pipe("pb", "skip", fused, S=2)
    _run([a, b], _batches({0: [3]}, n=2))
    assert _same(_snapshot(a), _snapshot(b))
    assert _counters(a) == _counters(b) and _counters(a)[1] == [1, 1]


def test_synchronous_schedule_skips_the_step_as_skip() -> None:
    a = _pipe("1f1b", "skip_update")
    b = _pipe("1f1b", "skip")
    _run([a, b], _batches({1: [2]}))
    assert _same(_snapshot(a), _snapshot(b)) and a.skipped_steps == 1
    assert all(st.bridge.skip is None for st in a.stages)  # one host read per step already


def test_refusals_name_what_is_wrong() -> None:
    stages = _stages()
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(PipelineConfigError, match=r"stage 0's optimizer is a torch\.optim\.sgd\.SGD.*found_inf.*engine\.optim"):
        Pipeline(
            stages, schedule="pb", chunks=4, loss_fn=mse, on_nonfinite="skip_update",
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )
    assert all(torch.equal(a, p) for a, p in zip(before, (p for m in stages for p in m.parameters()), strict=True))
    # (under gloo/NCCL the flags travel with the gradients: tests/runtime/ranks/test_distributed_gloo.py)
    spec = _pipe("pb", "skip").spec
    assert check_skip_update(spec, []) is True
    # a synchronous schedule checks the step's losses once before its update phase: any optimizer
    Pipeline(_stages(), schedule="gpipe", chunks=4, loss_fn=mse, on_nonfinite="skip_update",
             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_resume_unflushed_keeps_the_flags() -> None:
    """A flagged micro-batch in flight and a flagged pending group are saved with the
    state dict: save + load + continue equals the uninterrupted run bit for bit."""
    data = _batches({1: [2]}, n=4)  # micro-batch 6: in stage 0's stash, stage 1's pending group
    a = _pipe("pipedream", "skip_update", update_size=2)
    for x, y in data[:2]:
        a.step(x, y)
    state = a.state_dict()
    saved = state["in_flight"]["stages"]
    assert [e["flag"].item() for e in saved[0]["stash"]] == [1.0, 0.0]
    assert [sd["found_inf"].item() for sd in saved] == [0.0, 1.0, 0.0]
    b = _pipe("pipedream", "skip_update", update_size=2)
    b.load_state_dict(state)
    _run([a, b], data[2:])
    assert _same(_snapshot(a), _snapshot(b))
    _clean_after(b)
    # the counters are not saved (as with "skip"): stage 2 skipped its update before the save
    assert _counters(a)[1] == [1, 1, 1] and _counters(b)[1] == [1, 1, 0]
    c = _pipe("pipedream", "skip", update_size=2)
    with pytest.raises(engine.errors.CheckpointError, match="skip_update"):
        c.load_state_dict(state)


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("backward failure on the marked sample")


class _FailOnMarked(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return _FailInBackward.apply(y) if bool((x[:, 0] == 123.0).any()) else y


def _record_flag_ops(pipe: Pipeline, twin: StreamTwin) -> None:
    """Log each stage's flag adds/clears and gradient zeroing with the stream they ran on."""
    for st in pipe.stages:
        skip, store = st.bridge.skip, st.store

        def add(flag, k=st.index, orig=skip.add):
            twin.note(f"add{k}")
            orig(flag)

        def clear(k=st.index, orig=skip.clear):
            twin.note(f"clear{k}")
            orig()

        def zero_grads(*a, k=st.index, orig=store.zero_grads, **kw):
            twin.note(f"zero{k}")
            return orig(*a, **kw)

        skip.add, skip.clear, store.zero_grads = add, clear, zero_grads


@pytest.mark.parametrize("streams", ["plain", "cuda_twin"])
def test_failed_backward_discards_the_flags_with_the_gradients(streams: str, monkeypatch) -> None:
    """2BW: micro-batch 4 is flagged, then stage 0's backward of micro-batch 5 fails inside
    the autograd call it shares with stages 1 and 2 (micro-batches 6, 7): each of them
    discards its pending gradients -- micro-batch 4's NaN ones included -- and with them the
    flags, so no stale flag skips a later update; the run goes on clean.

    "cuda_twin" runs the executor's CUDA-stream paths on the CPU (tests/stream_twin.py):
    there a batch of backwards runs one stage at a time, and on the H100 its failure dropped
    nothing (found_inf stayed 1, issue 22). Every add and clear of a stage's flag, and every
    zeroing of its gradients, must run on that stage's stream."""
    box: list[StreamTwin] = []
    if streams == "cuda_twin":
        monkeypatch.setattr("engine.runtime.assemble.make_streams", twin_factory(box))
    stages = [m.to(DEVICE) for m in _stages()]
    stages[0] = _FailOnMarked(stages[0])
    pipe = Pipeline(stages, schedule="2bw", chunks=4, loss_fn=mse, optimizer=sgd,
                    on_nonfinite="skip_update", checkpoint="never")
    if box:
        _record_flag_ops(pipe, box[0])
    data = _batches({1: [0]})
    data[1][0][2, 0] = 123.0  # micro-batch 1 of step 1: global 5
    pipe.step(*data[0])
    with pytest.raises(RuntimeError, match="backward failure"):
        pipe.step(*data[1])
    for st in pipe.stages:
        assert 4 in st.pending_mbs and not st.bridge.skip.state().any()
        assert all(not g.any() for g in st.store.grad_state())
    if box:
        log = box[0].log
        assert {what for what, _ in log} >= {"clear0", "clear1", "clear2", "zero0", "zero2"}
        assert all(on == int(what[-1]) for what, on in log), log
    before = _snapshot(pipe)
    for x, y in data[2:]:
        pipe.step(x, y)
    pipe.flush()
    dropped, skipped, updates = _counters(pipe)
    assert dropped == 4 and skipped == [1, 1, 1] and updates == [4, 4, 4]
    _clean_after(pipe)
    # the updates after the failed group applied their gradients at every stage
    after = _snapshot(pipe)
    n = sum(1 for _ in pipe.stages[0].module.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before[:n], after[:n], strict=True))


def _fused(family: str):
    def make(p):
        if family == "sgd":
            return engine.optim.SGD(p, lr=0.05, momentum=0.9, fused=True)
        if family == "nadam":
            return engine.optim.NAdam(p, lr=0.01, fused=True)
        cls = engine.optim.AdamW if family == "adamw" else engine.optim.Adam
        return cls(p, lr=0.01, fused=True)
    return make


@needs_kernels
@pytest.mark.parametrize("family", ["sgd", "adam", "adamw", "nadam"])
def test_captured_skip_update_steps_never_sync_the_host(family: str) -> None:
    """The step a CUDA graph captures under skip_update (found_inf given) runs no op that
    waits for the device: tests/capture_twin.py stands in for the capture and refuses host
    syncs and copies between devices. On the H100, Adam's step count advanced through an
    .item() of found_inf and the capture broke at capture_end (issue 22). Bitwise the same
    run without graphs."""
    from capture_twin import SyncFreeCapture

    from engine.runtime.capture.optimizer_graphs import StepGraphs

    a = _pipe("pb", "skip_update", _fused(family), S=2)
    b = _pipe("pb", "skip_update", _fused(family), S=2)
    twins = []
    for st in a.stages:
        twins.append(SyncFreeCapture())
        st.bridge.graphs = StepGraphs(st.index, st.bridge.opt, twins[-1])
    _run([a, b], _batches({1: [2]}, n=3))
    assert all(t.captured for t in twins), "no step was captured"
    assert _same(_snapshot(a), _snapshot(b))
    assert _counters(a)[1] == [1, 1]


def test_the_capture_twin_refuses_a_host_sync() -> None:
    """The check can fail: the op Adam's step count used to take, and a bool() of a tensor."""
    from capture_twin import HostSyncError, NoHostSync

    steps = [torch.zeros(())]
    flag = torch.zeros(())
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), NoHostSync():
        torch._foreach_add_(steps, (flag == 0).to(torch.float32))
    with pytest.raises(HostSyncError, match="is_nonzero|_local_scalar_dense"), NoHostSync():
        bool(flag)
    with NoHostSync() as mode:
        torch._foreach_add_(steps, [(flag == 0).to(torch.float32)])
    assert "aten._foreach_add_.List" in mode.ops


@needs_kernels
def test_step_graphs_replay_the_skip() -> None:
    """With the step replayed from a (CUDA) graph, found_inf is a launch argument like any
    buffer: the accumulator is one persistent tensor, so the key repeats and skipped and
    applied updates replay from the same graph. On CPU a recorder stands in for the graph
    (tests/runtime/capture/test_runtime_graphs.py); bitwise the run without graphs."""
    from test_runtime_graphs import Recorder

    from engine.runtime.capture.optimizer_graphs import StepGraphs

    def fused(p):
        return engine.optim.SGD(p, lr=0.05, momentum=0.9, fused=True)

    a = _pipe("pb", "skip_update", fused, S=2)
    b = _pipe("pb", "skip_update", fused, S=2)
    for st in a.stages:
        st.bridge.graphs = StepGraphs(st.index, st.bridge.opt, Recorder())
    _run([a, b], _batches({2: [1]}, n=3))  # update 9 is skipped, replayed like updates 2..11
    assert _same(_snapshot(a), _snapshot(b))
    assert _counters(a)[1] == [1, 1]
    assert all(s["replays"] == 10 and s["captures"] == 1 for s in a.stats()["cuda_graphs"])


@pytest.mark.cuda
def test_gpu_graph_replays_skip_updates() -> None:
    """The same with real CUDA graphs (Pipeline(cuda_graphs=True)); needs a GPU."""
    def run(graphs: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(16, 32), nn.Tanh()).cuda(), nn.Linear(32, 4).cuda()]
        pipe = Pipeline(stages, schedule="pb", chunks=4, loss_fn=mse, optimizer=adam,
                        on_nonfinite="skip_update", cuda_graphs=graphs)
        g = torch.Generator(device="cuda").manual_seed(1)
        for k in range(8):
            x = torch.randn(4, 16, device="cuda", generator=g)
            y = torch.randn(4, 4, device="cuda", generator=g)
            if k == 4:
                y[1] = float("nan")
            pipe.step(x, y)
        pipe.flush()
        torch.cuda.synchronize()
        return [p.detach().cpu() for st in pipe.stages for p in st.store.params], pipe.stats()

    eager, _ = run(False)
    graphed, stats = run(True)
    assert all(torch.equal(x, y) for x, y in zip(eager, graphed, strict=True))
    assert stats["skipped_updates"] == [1, 1]
    assert all(s["replays"] > 0 for s in stats["cuda_graphs"])


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_gpu_steady_state_steps_never_sync_the_host(graphs: bool) -> None:
    """Issue 10's "no host syncs in steady state": once warm (kernels compiled, state made,
    graphs recorded), pb steps with skip_update run under CUDA's sync debug mode "error", which
    raises at any synchronizing call (an .item(), a bool() of a CUDA tensor, a blocking copy)."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(16, 32), nn.Tanh()).cuda(), nn.Linear(32, 4).cuda()]
    sgd = lambda p: engine.optim.SGD(p, lr=0.05, momentum=0.9,  # noqa: E731
                                     spike_compensation=True, prediction="linear")
    pipe = Pipeline(stages, schedule="pb", chunks=4, loss_fn=mse, optimizer=sgd,
                    on_nonfinite="skip_update", cuda_graphs=graphs)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(4, 16, device="cuda", generator=g),
                torch.randn(4, 4, device="cuda", generator=g)) for _ in range(9)]
    for x, y in batches[:6]:
        pipe.step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[6:]:
            pipe.step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if graphs:
        assert all(s["replays"] > 0 for s in pipe.stats()["cuda_graphs"])


def test_skip_flags_count_each_skipped_group_once() -> None:
    """The accumulator is never zeroed per update: a group's first flag is copied in, later
    ones added. A group of one flag counts it as it is (one launch), a group of several (a
    sum, 2 here) or one averaged over replicas (a fraction) compares it with zero: every
    skipped group counts once, whatever its found_inf."""
    from engine.runtime.stage.device_flags import SkipFlags

    one, zero = torch.ones(()), torch.zeros(())
    f = SkipFlags(torch.device("cpu"))
    f.found_inf.fill_(7.0)  # a consumed group's sum: stale, never read
    groups = [[one], [zero], [one, one], [one, zero], [zero, zero], [one]]
    for g in groups:
        for flag in g:
            f.add(flag)
        assert f.found_inf.item() == sum(x.item() for x in g)
        f.after_step()
    assert f.skipped.item() == 4
    f.add(one)
    f.averaged()  # the data-parallel mean of 1 and 0
    f.found_inf.mul_(0.5)
    f.after_step()
    f.settle()  # a group no flag reached reads zero
    assert f.skipped.item() == 5 and f.found_inf.item() == 0.0
