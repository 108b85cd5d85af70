"""Asynchronous windows captured (``cuda_graphs="program"`` with pb; issue 23 item 1), proven
on CPU with a tape twin (engine.runtime.capture.graph_twin.TapeTwin): a replay re-executes the
capture's aten calls on the capture's tensors and runs none of the window's Python, as a CUDA
graph does. So the rings, their rotation and the host shift the capture layer applies after
each replay are exercised exactly as on a GPU, and every result must equal the eager
pipeline's bit for bit -- while replaying, after ``flush()``, and when learning again.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.optim
from engine.errors import PipelineConfigError
from engine.runtime.capture import asynchronous as capture_async
from engine.runtime.capture.synchronous import ASYNC_REASON, use_backend
from engine.runtime.capture.audit import _reference_optimizer, _state
from engine.runtime.capture.graph_twin import TapeTwin
from test_capture_audit import MITIGATIONS

S, M, D = 3, 3, 4


def make(mitigation: str = "plain", mode: str | bool = "program", stage: type[nn.Module] | None = None,
         schedule: str = "pb", tensor_lr: bool = False, **extra) -> engine.Pipeline:
    opt_kw, pipe_kw = MITIGATIONS[mitigation]
    pipe_kw = {**pipe_kw, "on_nonfinite": "skip_update", **extra}
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    stages.append(nn.Linear(D, 2))
    if stage is not None:
        stages[1] = nn.Sequential(stages[1], stage())
    return engine.Pipeline(
        stages, schedule=schedule, chunks=M, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(
            p, lr=torch.tensor(0.1) if tensor_lr else 0.1, momentum=0.9, **opt_kw),
        checkpoint="never", cuda_graphs=mode, **pipe_kw,
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(M, D, generator=g), torch.randn(M, 2, generator=g)) for _ in range(n)]


def bitwise(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same(pipe: engine.Pipeline, ref: engine.Pipeline) -> bool:
    return all(bitwise(a, b) for a, b in zip(_state(pipe), _state(ref), strict=True))


def run_both(mitigation: str, steps: int, stage=None, twin: TapeTwin | None = None):
    twin = twin or TapeTwin()
    with _reference_optimizer(), use_backend(twin):
        pipe = make(mitigation, stage=stage)
    ref = make(mitigation, mode=False, stage=stage)
    data = batches(steps)
    with _reference_optimizer():
        for k, (x, y) in enumerate(data):
            a, b = pipe.step(x, y), ref.step(x, y)
            assert bitwise(a, b), f"step {k}: loss {a} != eager {b}"
            assert same(pipe, ref), f"step {k}: weights, gradients or state differ"
    return pipe, ref, twin


@pytest.mark.parametrize("mitigation", list(MITIGATIONS))
def test_pb_windows_replay_bitwise(mitigation: str) -> None:
    pipe, ref, twin = run_both(mitigation, 16)
    st = pipe.stats()["capture"]
    assert st["captures"] == 1 and st["replays"] >= 5, st
    # the window, and the ring's rotation (captured before the first replay: it ran then)
    assert twin.captures == 2 and twin.replays == 2 * st["replays"] - 1
    assert st["ring"]["depth"] == 2 and st["ring"]["slots"] > 0
    with _reference_optimizer():
        pipe.flush()
        ref.flush()
        assert same(pipe, ref)
        assert pipe.steps == ref.steps and pipe.stats()["updates"] == ref.stats()["updates"]
        for x, y in batches(12):  # learning again after the flush, then a capture
            assert bitwise(pipe.step(x, y), ref.step(x, y))
        assert same(pipe, ref)
    assert pipe.stats()["capture"]["captures"] == 2


def test_replays_run_no_window_python() -> None:
    """The twin's replay runs no Python of the window: the stages' forwards are not called."""
    calls = []

    class Count(nn.Module):
        def forward(self, x):
            calls.append(self)
            return x + 0.0

    pipe, ref, _ = run_both("plain", 16, stage=Count)
    replays = pipe.stats()["capture"]["replays"]
    mine = sum(1 for m in calls if any(m is x for x in pipe.stages[1].module.modules()))
    theirs = len(calls) - mine
    assert replays >= 4 and mine == theirs - replays * M


@pytest.mark.parametrize("broken", ["shift", "rotate"])
def test_without_the_shift_or_the_rotation_replays_go_wrong(monkeypatch, broken: str) -> None:
    if broken == "shift":
        monkeypatch.setattr(capture_async.HostShift, "apply", lambda self, root: None)
    else:
        monkeypatch.setattr(capture_async.AsyncCapture, "_rotate", lambda self, w: None)
    with pytest.raises(AssertionError):
        pipe, ref, _ = run_both("sc+lwp", 16)
        with _reference_optimizer():
            pipe.flush()
            ref.flush()
        assert same(pipe, ref) and pipe.steps == ref.steps


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_during_a_replay_finishes_the_step_then_raises() -> None:
    """A SIGINT while a window replays: the step completes (a graph cannot stop halfway), the
    host is shifted, then KeyboardInterrupt is raised; the pipeline equals the one that ran
    the step uninterrupted, and both go on equal, still replaying."""
    import os
    import signal

    pipe, ref, _ = run_both("sc", 12)
    w = pipe.parts.capture._window
    assert w is not None
    inner = w.replay

    def replay() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        inner()

    w.replay = replay
    x, y = batches(13)[12]
    with _reference_optimizer():
        with pytest.raises(KeyboardInterrupt):
            pipe.step(x, y)
        w.replay = inner
        ref.step(x, y)
        assert same(pipe, ref) and pipe.steps == ref.steps
        before = pipe.stats()["capture"]["replays"]
        for x, y in batches(4):
            assert bitwise(pipe.step(x, y), ref.step(x, y))
        assert same(pipe, ref)
    assert pipe.stats()["capture"]["replays"] == before + 4


class ReadsBack(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if x.abs().max().item() > 100 else x


def test_a_window_that_reads_the_host_stays_eager(monkeypatch) -> None:
    monkeypatch.setattr(capture_async, "GIVE_UP", 6)
    pipe, ref, twin = run_both("plain", 13, stage=ReadsBack)
    st = pipe.stats()["capture"]
    assert st["captures"] == 0 and twin.captures == 0
    assert "reads the host" in st["last_eager_reason"] and "test_capture_async.py:forward" in st["last_eager_reason"]


@pytest.mark.parametrize(("schedule", "extra", "words"), [
    ("pipedream", {}, ASYNC_REASON),
    ("2bw", {}, ASYNC_REASON),
    ("pb", {"on_nonfinite": "raise"}, "on_nonfinite='skip_update'"),
])
def test_refused_at_build(schedule: str, extra: dict, words: str) -> None:
    with use_backend(TapeTwin()), pytest.raises(PipelineConfigError, match=words):
        make(schedule=schedule, **extra)


# ---------------------------------------------------------------------- GPU (never run yet)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
COUNTERS = ("steps", "skipped_steps", "dropped_microbatches", "updates", "skipped_updates")


def _gpu(mitigation: str, mode: object, width: int = 64, tensor_lr: bool = False,
         **kw) -> engine.Pipeline:
    opt_kw, pipe_kw = MITIGATIONS[mitigation]
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(S - 1)]
    stages.append(nn.Linear(width, 2))
    return engine.Pipeline(
        [m.cuda() for m in stages], schedule="pb", chunks=4, loss_fn=F.mse_loss,
        checkpoint="never", cuda_graphs=mode, cuda_streams=False,
        **{**pipe_kw, "on_nonfinite": "skip_update", **kw},
        optimizer=lambda p: engine.optim.SGD(
            p, lr=torch.tensor(0.05, device="cuda") if tensor_lr else 0.05, momentum=0.9, **opt_kw))


def _gpu_data(n: int, width: int = 64, bad: int | None = None):
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for k in range(n):
        x = torch.randn(4, width, generator=g, device="cuda")
        if k == bad:
            x[1, 0] = float("nan")  # the second micro-batch of a replayed window
        out.append((x, torch.randn(4, 2, generator=g, device="cuda")))
    return out


def _cuda_run(mitigation: str, steps: int, bad: int | None = None, **kw):
    a, b = _gpu(mitigation, "program", **kw), _gpu(mitigation, False, **kw)
    for x, y in _gpu_data(steps, bad=bad):
        la, lb = a.step(x, y), b.step(x, y)
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))  # NaN losses by bits
    torch.cuda.synchronize()
    assert same(a, b)
    return a, b


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("mitigation", list(MITIGATIONS))
def test_cuda_pb_captured_equals_eager_bitwise(mitigation: str) -> None:
    a, b = _cuda_run(mitigation, 24)
    cap = a.stats()["capture"]
    assert cap["captures"] == 1 and cap["replays"] >= 8, (cap["last_eager_reason"], cap)
    a.flush()
    b.flush()
    torch.cuda.synchronize()
    assert same(a, b)
    assert {k: a.stats()[k] for k in COUNTERS} == {k: b.stats()[k] for k in COUNTERS}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("mitigation", ["plain", "sc+lwp"])
def test_cuda_a_nan_mid_window_skips_the_updates_eager_skips(mitigation: str) -> None:
    a, b = _cuda_run(mitigation, 24, bad=18)
    assert a.stats()["capture"]["replays"] >= 8
    assert {k: a.stats()[k] for k in COUNTERS} == {k: b.stats()[k] for k in COUNTERS}
    assert a.stats()["dropped_microbatches"] == 1


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("mitigation", ["plain", "sc+lwp"])
def test_cuda_an_lr_scheduler_of_a_tensor_lr_is_captured(mitigation: str) -> None:
    """The LR feed on a GPU: fused kernels load the Tensor lr the slots were copied into;
    one capture, replays with a changing lr, bitwise eager (lrs and schedulers too)."""
    a, b = _cuda_run(mitigation, 24, tensor_lr=True, lr_scheduler=SCHEDULERS["exponential"])
    cap = a.stats()["capture"]
    assert cap["captures"] == 1 and cap["replays"] >= 8, (cap["last_eager_reason"], cap)
    assert all(torch.equal(u, v) for u, v in zip(_lrs(a), _lrs(b), strict=True))
    assert a.stages[0].scheduler.last_epoch == b.stages[0].scheduler.last_epoch


def test_every_window_runs_inside_the_backends_stream() -> None:
    """A backend with ``running()`` (CUDA: SideStreamGraphs' side stream) has every window --
    learnt, captured, replayed -- run inside it: a captured pb window runs backwards of
    forwards from earlier windows, which autograd launches on their forward's stream."""
    import contextlib

    class Sided(TapeTwin):
        def __init__(self) -> None:
            super().__init__()
            self.inside = False
            self.entered = 0

        @contextlib.contextmanager
        def running(self):
            self.inside = True
            self.entered += 1
            try:
                yield
            finally:
                self.inside = False

        def capture(self, window):
            assert self.inside
            replay = super().capture(window)

            def checked() -> None:
                assert self.inside
                replay()

            return checked

    twin = Sided()
    pipe, ref, _ = run_both("sc+lwp", 14, twin=twin)
    assert twin.entered == 14 and pipe.stats()["capture"]["replays"] >= 3


def test_an_lr_scheduler_of_a_float_lr_keeps_the_windows_eager() -> None:
    """A float lr is a launch argument and a replay would not run the scheduler: every window
    runs eagerly, with the reason."""
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)  # noqa: E731
    with _reference_optimizer(), use_backend(TapeTwin()):
        pipe = make("plain", lr_scheduler=sched)
    ref = make("plain", mode=False, lr_scheduler=sched)
    with _reference_optimizer():
        for x, y in batches(14):
            assert bitwise(pipe.step(x, y), ref.step(x, y))
    cap = pipe.stats()["capture"]
    assert cap["captures"] == 0 and cap["learning"] == 0 and "LR scheduler" in cap["last_eager_reason"]
    assert same(pipe, ref)


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97),
}


def _lrs(pipe: engine.Pipeline) -> list[torch.Tensor]:
    return [g["lr"] for st in pipe.stages for g in st.bridge.opt.param_groups]


def _device_lr_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin of the fused kernels' device lr on CPU: engine.optim's reference SGD is given
    the Tensor lr itself (an alias marked requires_grad: its ``addcmul_`` branch reads lr
    through aten on the device, no host read), as the fused kernels load it on CUDA. The
    captured and the eager pipeline both use it: the comparison is the capture layer's."""
    def effective_lr(group):
        lr = group["lr"]
        return lr.detach().requires_grad_() if isinstance(lr, torch.Tensor) else lr

    monkeypatch.setattr(engine.optim.SGD, "effective_lr", staticmethod(effective_lr))


def _run_scheduled(kind: str, mitigation: str, steps: int = 26, flush_at: int = 13):
    sched = SCHEDULERS[kind]
    with _reference_optimizer(), use_backend(TapeTwin()):
        pipe = make(mitigation, lr_scheduler=sched, tensor_lr=True)
    ref = make(mitigation, mode=False, lr_scheduler=sched, tensor_lr=True)
    with _reference_optimizer():
        for k, (x, y) in enumerate(batches(steps)):
            assert bitwise(pipe.step(x, y), ref.step(x, y)), f"step {k}"
            assert same(pipe, ref), f"step {k}"
            assert all(bitwise(a, b) for a, b in zip(_lrs(pipe), _lrs(ref), strict=True)), f"step {k}"
            if k == flush_at:
                pipe.flush()
                ref.flush()
    for p, q in zip(pipe.stages, ref.stages, strict=True):
        assert p.scheduler.state_dict()["last_epoch"] == q.scheduler.state_dict()["last_epoch"] > 40
    assert float(_lrs(pipe)[0]) < 0.1
    return pipe.stats()["capture"]


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_an_lr_scheduler_of_a_tensor_lr_is_captured(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline(lr_scheduler=...) of Tensor lrs: the scheduler steps on the host before each
    window into static slots, and each update inside copies its slot in (lr_feed.py): one
    graph replays a changing lr, bitwise eager at every step -- through flush() (a window
    with fewer updates than slots) and learning again -- with eager's lr tensors and
    scheduler states."""
    _device_lr_reference(monkeypatch)
    cap = _run_scheduled(kind, "plain")
    assert cap["captures"] == 2 and cap["replays"] >= 6, cap  # (4 before the flush)


@pytest.mark.parametrize("mitigation", ["plain", "sc+lwp"])
def test_the_lr_feed_is_eager_in_learning_windows(mitigation: str) -> None:
    """The feed in windows that run their Python (learning, eager; here the reference path
    reads the Tensor lr on the host, so nothing is captured): eager's lrs at every update,
    also with weight prediction reading lr between a stage's updates (SC+LWP)."""
    cap = _run_scheduled("exponential", mitigation)
    assert cap["captures"] == 0 and cap["learning"] > 0, cap


def test_without_the_feed_a_replay_keeps_the_captured_lr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that the test above can fail: a replay that does not refill the slots
    (prepare skipped) replays the captured window's lrs, and eager differs."""
    from engine.runtime.capture import lr_feed

    _device_lr_reference(monkeypatch)
    real = lr_feed.LrFeed.prepare

    def stale(self, n, exact=False):
        if exact:  # a replay: leave the slots as the capture filled them
            self.prepared, self.used, self._saved = n, 0, None
            return
        real(self, n, exact)

    monkeypatch.setattr(lr_feed.LrFeed, "prepare", stale)
    with pytest.raises(AssertionError, match=r"step \d+"):
        _run_scheduled("lambda", "plain")


def test_keys_that_change_every_step_pause_learning() -> None:
    """lr set by hand at every step (a launch argument: a new key each time): after a few
    learning windows the pipeline runs plain eager steps (learning records every call)."""
    with _reference_optimizer(), use_backend(TapeTwin()):
        pipe = make("plain")
    ref = make("plain", mode=False)
    with _reference_optimizer():
        for k, (x, y) in enumerate(batches(20)):
            for p in (pipe, ref):
                for st in p.stages:
                    for g in st.bridge.opt.param_groups:
                        g["lr"] = 0.1 / (1 + k)
            assert bitwise(pipe.step(x, y), ref.step(x, y))
    cap = pipe.stats()["capture"]
    assert cap["captures"] == 0 and cap["learning"] <= capture_async.CHANGING + 1, cap
    assert "changed at every step" in cap["last_eager_reason"]
    assert same(pipe, ref)
