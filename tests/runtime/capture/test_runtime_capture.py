"""Pipeline(cuda_graphs="program"): whole synchronous steps captured and replayed (issue 23).

On CPU the graph is engine.runtime.capture.graph_twin.RecordingTwin: it records the window at capture
and, at every replay, runs the window again with every value made inside it redirected into
the capture's tensors (as a graph's private pool) and raises if the replay made other calls,
read other outside memory or read the host -- what a real graph would have replayed wrongly.
The host bookkeeping of a replay is the capture layer's own (the twin's re-run is undone), so
counters are checked too. Every test compares with the same pipeline run eagerly, bit for
bit. The CUDA-marked tests at the end prove on a GPU what the twin cannot.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.optim
from engine.errors import NonFiniteLossError, PipelineConfigError
from engine.runtime.capture.synchronous import ASYNC_REASON, use_backend
from engine.runtime.capture.audit import audit_pipeline
from engine.runtime.capture.graph_twin import RecordingTwin

D = 4
SYNC = ["gpipe", "1f1b", "zbh1", "naive", "interleaved"]


def _stages(n: int = 3, extra: type[nn.Module] | None = None) -> list[nn.Module]:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n - 1)]
    mods.append(nn.Linear(D, 2))
    if extra is not None:
        mods[1] = nn.Sequential(mods[1], extra())
    return mods


def make(schedule: str = "1f1b", mode: object = "program", *, twin: RecordingTwin | None = None,
         extra: type[nn.Module] | None = None, **kw) -> engine.Pipeline:
    if schedule == "interleaved":
        kw.setdefault("virtual_stages", 2)
        n = 4
    else:
        n = 3
    kw.setdefault("chunks", 3 if schedule != "interleaved" else 4)
    kw.setdefault("optimizer", lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9))
    build = lambda: engine.Pipeline(  # noqa: E731
        _stages(n, extra), schedule=schedule, loss_fn=F.mse_loss, checkpoint="never",
        cuda_graphs=mode, **kw)
    if mode != "program":
        return build()
    with use_backend(twin or RecordingTwin()):
        return build()


def data(n: int, batch: int = 12, seed: int = 1, bad: int | None = None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        x, y = torch.randn(batch, D, generator=g), torch.randn(batch, 2, generator=g)
        if k == bad:
            x[1, 0] = float("nan")
        out.append((x, y))
    return out


def same_state(a: engine.Pipeline, b: engine.Pipeline) -> bool:
    for p, q in zip(a.stages, b.stages, strict=True):
        # gradients as they count: a GPU stage leaves them stale after an update, a
        # rollback zeroes them (fresh_grads.py)
        for u, v in zip([*p.store.live_flats(), *p.store.grad_state()],
                        [*q.store.live_flats(), *q.store.grad_state()], strict=True):
            if not torch.equal(u, v):
                return False
        if p.bridge is not None:
            for (sa, sb) in zip(p.bridge.opt.state.values(), q.bridge.opt.state.values(), strict=True):
                for k in sa:
                    if isinstance(sa[k], torch.Tensor) and not torch.equal(sa[k], sb[k]):
                        return False
    return True


COUNTERS = ("steps", "skipped_steps", "dropped_microbatches", "updates", "skipped_updates",
            "measured_delays")


def run_both(a, b, batches, counters=COUNTERS):
    for x, y in batches:
        la, lb = a.step(x, y), b.step(x, y)
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))  # NaN by its bits
        assert same_state(a, b)
    sa, sb = a.stats(), b.stats()
    assert {k: sa[k] for k in counters} == {k: sb[k] for k in counters}
    return sa["capture"]


@pytest.mark.parametrize("schedule", SYNC)
def test_captured_steps_equal_eager_bitwise(schedule: str) -> None:
    twin = RecordingTwin()
    a, b = make(schedule, twin=twin), make(schedule, False)
    cap = run_both(a, b, data(6, batch=12 if schedule != "interleaved" else 8))
    # step 0 creates the optimizer state, step 1 is the warm-up of the key, 2 captures
    assert (cap["eager"], cap["captures"], cap["replays"]) == (2, 1, 3), cap
    assert (twin.captures, twin.replays) == (1, 3)
    assert cap["mode"] == "program" and cap["window"] == "synchronous step"


@pytest.mark.parametrize("kw", [{"clip_grad_norm": 1.0}, {"autocast": torch.bfloat16},
                                {"autocast": torch.float16}], ids=["clip", "bf16", "fp16-scaled"])
def test_step_features_are_captured_and_equal_eager(kw) -> None:
    """Clipping by the global norm and autocast (float16: device-side loss scaling) keep
    their state on the device: captured, replayed, equal to eager."""
    a, b = make("1f1b", **kw), make("1f1b", False, **kw)
    cap = run_both(a, b, data(6))
    assert (cap["captures"], cap["replays"]) == (1, 3), cap


def test_staging_buffers_are_static_and_copied_once_per_leaf() -> None:
    """Trees (a dict with a mask and a constant leaf; tuple targets): one buffer per tensor
    leaf and slot, the same addresses every step, one copy per leaf and slot per step."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, mask, scale):
            return torch.tanh(self.lin(x * mask.unsqueeze(-1)) * scale)

    def loss(out, t):
        return F.mse_loss(out, t[0]) + 0.0 * t[1].sum()

    def build(mode):
        torch.manual_seed(0)
        stages = [Masked(), nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, 2)]
        with use_backend(RecordingTwin()):
            return engine.Pipeline(stages, schedule="gpipe", chunks=3, loss_fn=loss,
                                   checkpoint="never", cuda_graphs=mode,
                                   optimizer=lambda p: engine.optim.SGD(p, lr=0.1))

    a, b = build("program"), build(False)
    g = torch.Generator().manual_seed(3)
    ptrs = None
    for k in range(5):
        x = {"x": torch.randn(6, D, generator=g), "mask": torch.rand(6, generator=g) > 0.3,
             "scale": 0.5}
        y = (torch.randn(6, 2, generator=g), torch.arange(6))
        assert torch.equal(a.step(x, y), b.step(x, y))
        assert same_state(a, b)
        (staging,) = a.parts.capture._staging.values()
        now = [t.data_ptr() for t in staging.buffers()]
        assert len(now) == 3 * 4  # slots x (x, mask, target, ids)
        assert ptrs is None or now == ptrs
        ptrs = now
        assert staging.copies == 12 * (k + 1)
    assert a.stats()["capture"]["replays"] == 2  # first step, warm-up, capture, 2 replays


def test_the_twin_checks_the_host_bookkeeping_of_a_replay(monkeypatch) -> None:
    """A replay runs no Python: every host field a step changes must come from the captured
    difference. Dropping one (the executor's step count) is caught by the twin."""
    from engine.runtime.capture import synchronous as capture
    from engine.runtime.capture.graph_twin import ReplayDivergence

    real = capture._Delta.apply

    def forgets_steps(self, ex):
        real(self, ex)
        ex.steps -= self.ex[0]

    monkeypatch.setattr(capture._Delta, "apply", forgets_steps)
    a = make("gpipe")
    batches = data(4)
    for x, y in batches[:3]:
        a.step(x, y)
    with pytest.raises(ReplayDivergence, match="executor.steps"):
        a.step(*batches[3])


def test_a_new_shape_recaptures_once_then_replays() -> None:
    twin = RecordingTwin()
    a, b = make("1f1b", twin=twin), make("1f1b", False)
    small, large = data(4, batch=6, seed=1), data(4, batch=9, seed=2)
    run_both(a, b, small)  # eager, warm-up, capture, replay
    cap = run_both(a, b, large)  # warm-up, capture, replay, replay
    assert (cap["captures"], cap["replays"], cap["graphs"]) == (2, 3, 2), cap
    cap = run_both(a, b, small[:2])  # the first shape's graph is still cached
    assert (cap["captures"], cap["replays"]) == (2, 5), cap


def test_the_cache_is_bounded() -> None:
    a, b = make("gpipe"), make("gpipe", False)
    a.parts.capture.cache = 2
    for batch in (6, 9, 12):
        run_both(a, b, data(3, batch=batch, seed=batch))
    cap = a.stats()["capture"]
    assert cap["graphs"] == 2 and cap["evictions"] == 1, cap


def test_an_lr_schedule_recaptures_per_value_and_equals_eager() -> None:
    """The fused kernels take lr as a host number: a new value is a new key (warm-up, then
    capture); the stage's scheduler steps on the host after every replay."""
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)  # noqa: E731
    a, b = make("1f1b", lr_scheduler=sched), make("1f1b", False, lr_scheduler=sched)
    cap = run_both(a, b, data(12))
    assert cap["captures"] == 3 and cap["replays"] == 5, cap
    assert [g["lr"] for g in a.stages[0].bridge.opt.param_groups] == \
        [g["lr"] for g in b.stages[0].bridge.opt.param_groups]


def test_an_lr_changing_every_step_runs_eagerly_with_the_reason() -> None:
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))  # noqa: E731
    a, b = make("gpipe", lr_scheduler=sched), make("gpipe", False, lr_scheduler=sched)
    cap = run_both(a, b, data(5))
    assert cap["captures"] == 0 and cap["eager"] == 5
    assert "optimizer options changed" in cap["last_eager_reason"]
    assert "launch argument, not a device tensor" in cap["last_eager_reason"]


def _device_lr_sgd(p):
    """SGD whose lr is a float32 tensor beside the params, read by the fused kernels on the
    device (the interpreter on CPU)."""
    return engine.optim.SGD(p, lr=torch.tensor(0.1), momentum=0.9, fused=True)


def _write_lrs(pipe: engine.Pipeline, value: float) -> None:
    """What torch's LR schedulers do to a Tensor lr: write it in place."""
    for st in pipe.stages:
        for g in st.bridge.opt.param_groups:
            g["lr"].fill_(value)


# the CPU stages' fused kernels run under Triton's interpreter only (conftest.py sets it
# where there is no GPU)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="fused kernels on CPU stages need TRITON_INTERPRET=1")


@interpreted
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_device_lr_changing_every_step_never_recaptures(schedule: str) -> None:
    """lr as a device tensor (issue 23): the capture key holds its address, not its value,
    so an LR schedule that writes it every step is captured once and replayed; bitwise the
    eager run with the same tensors, and the eager run given the same values as floats."""
    kw = dict(optimizer=_device_lr_sgd)
    a, b = make(schedule, **kw), make(schedule, False, **kw)
    c = make(schedule, False, optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9,
                                                                    fused=True))
    for k, (x, y) in enumerate(data(6)):
        value = float(torch.tensor(0.1 / (1 + k)))  # a float32 number: both paths see it
        _write_lrs(a, value)
        _write_lrs(b, value)
        for st in c.stages:
            for g in st.bridge.opt.param_groups:
                g["lr"] = value
        la, lb, lc = a.step(x, y), b.step(x, y), c.step(x, y)
        assert torch.equal(la, lb) and torch.equal(la, lc)
        assert same_state(a, b) and same_state(a, c)
    cap = a.stats()["capture"]
    # step 1 creates the optimizer state, step 2 is the key's warm-up: then one capture
    assert (cap["captures"], cap["replays"], cap["eager"]) == (1, 3, 2), cap


@interpreted
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_lr_scheduler_of_a_device_lr_never_recaptures(schedule: str) -> None:
    """Pipeline(lr_scheduler=...) with a Tensor lr: the scheduler steps after the window (its
    fill_ is never recorded), so one graph replays a changing lr, bitwise eager, and the lr
    tensors and scheduler states end as eager's (inside the window the twin's replay would
    diverge from its capture: the previous xfail)."""
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))  # noqa: E731
    a = make(schedule, optimizer=_device_lr_sgd, lr_scheduler=sched)
    b = make(schedule, False, optimizer=_device_lr_sgd, lr_scheduler=sched)
    cap = run_both(a, b, data(6))
    assert cap["captures"] == 1 and cap["replays"] == 3, cap
    for p, q in zip(a.stages, b.stages, strict=True):
        assert p.scheduler.state_dict()["last_epoch"] == q.scheduler.state_dict()["last_epoch"] == 6
        for g, h in zip(p.bridge.opt.param_groups, q.bridge.opt.param_groups, strict=True):
            assert torch.equal(g["lr"], h["lr"]) and g["lr"].item() != 0.1


@pytest.mark.parametrize("policy", ["skip", "skip_update"])
def test_a_nan_skips_every_update_as_eager(policy: str) -> None:
    """The loss check on the device: the step's non-finite count is every stage's found_inf
    (a NaN in the warm-up step, which runs the window eagerly); the steps after it replay."""
    a, b = make("1f1b", on_nonfinite=policy), make("1f1b", False, on_nonfinite=policy)
    # "skip_update" reads nothing: the skipped update still counts as one (as on
    # asynchronous schedules), where eager's synchronous "skip_update" acts as "skip"
    counters = COUNTERS if policy == "skip" else ("steps", "skipped_steps", "dropped_microbatches")
    cap = run_both(a, b, data(7, bad=1), counters)
    assert cap["replays"] == 4, cap
    s = a.stats()
    assert s["skipped_steps"] == 1 and s["dropped_microbatches"] == 1
    assert s["updates"] == [7 if policy == "skip_update" else 6] * 3


def test_a_nan_raises_and_changes_nothing() -> None:
    a, b = make("gpipe"), make("gpipe", False)
    batches = data(7, bad=1)
    run_both(a, b, batches[:1])
    for p in (a, b):
        with pytest.raises(NonFiniteLossError, match="rolled back"):
            p.step(*batches[1])
    assert same_state(a, b)
    cap = run_both(a, b, batches[2:])
    assert cap["replays"] == 4, cap  # the raising warm-up still made the key seen


def test_the_twin_catches_the_cpu_reference_path_branching_on_found_inf() -> None:
    """engine.optim's CPU reference step reads found_inf on the host and returns early: a
    graph of it would replay the finite branch. The twin says so (on CUDA the fused kernels
    read found_inf on the device: test_cuda_a_nan_in_a_replay_skips_as_eager)."""
    from engine.runtime.capture.graph_twin import ReplayDivergence

    a = make("1f1b", on_nonfinite="skip")
    batches = data(5, bad=4)
    for x, y in batches[:4]:
        a.step(x, y)
    with pytest.raises(ReplayDivergence, match="differs from its capture"):
        a.step(*batches[4])


def ctrl_c_during_a_replay(a, b, batches) -> None:
    """A SIGINT arrives while a's step replays: the step completes (a graph cannot stop
    halfway), then KeyboardInterrupt is raised; a then equals b, which ran the step
    uninterrupted, and the two go on equal."""
    for x, y in batches[:4]:
        a.step(x, y)
        b.step(x, y)
    (graph,) = a.parts.capture._graphs.values()
    inner = graph.replay

    def replay() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        inner()

    graph.replay = replay
    with pytest.raises(KeyboardInterrupt):
        a.step(*batches[4])
    graph.replay = inner
    b.step(*batches[4])
    assert same_state(a, b)
    for x, y in batches[5:]:
        assert torch.equal(a.step(x, y), b.step(x, y))
    assert {k: a.stats()[k] for k in COUNTERS} == {k: b.stats()[k] for k in COUNTERS}
    assert a.stats()["capture"]["replays"] == len(batches) - 3


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_during_a_replay_finishes_the_step_then_raises() -> None:
    a, b = make("gpipe"), make("gpipe", False)
    ctrl_c_during_a_replay(a, b, data(7))
    assert same_state(a, b)


class ReadsBack(nn.Module):
    """Breaks "no host sync": a Python branch on a tensor's value."""

    def forward(self, x):
        return x * 2 if float(x.detach().abs().sum()) > 0 else x


def test_a_step_that_reads_the_host_is_not_captured() -> None:
    a, b = make("1f1b", extra=ReadsBack), make("1f1b", False, extra=ReadsBack)
    cap = run_both(a, b, data(5))
    assert cap["captures"] == 0 and cap["eager"] == 5, cap
    assert "reads the host" in cap["last_eager_reason"]
    assert "test_runtime_capture.py:forward" in cap["last_eager_reason"]


def test_an_action_hook_runs_eagerly() -> None:
    a, b = make("gpipe"), make("gpipe", False)
    seen = []
    a.parts.executor.action_hook = lambda s, k, i: seen.append(k)
    cap = run_both(a, b, data(3))
    assert cap["captures"] == 0 and "action hook" in cap["last_eager_reason"] and seen


@pytest.mark.parametrize("policy", ["raise", "skip_update"])
@pytest.mark.parametrize("schedule", SYNC)
def test_capture_audit_passes_in_program_mode(schedule: str, policy: str) -> None:
    """The merged audit found two obstacles in synchronous windows: the user's batch
    (addresses move) and the loss check's host read. In program mode the window reads the
    staging buffers (the only calls that read the user's batch are the staging copies, one
    per leaf and slot), and it reads nothing on the host: what is left is outside the
    window ("raise" reads the per-loss flags once after it) or CPU-only (engine.optim's
    reference path reads found_inf; the fused CUDA kernels read it on the device)."""
    n = 4 if schedule == "interleaved" else 3
    M = 4 if schedule == "interleaved" else 3
    batches = data(6, batch=2 * M)
    report = audit_pipeline(lambda: make(schedule, on_nonfinite=policy), batches, warmup=3,
                            name=f"{schedule}/program")
    report.assert_ok("same_ops", "bitwise_eager")
    moved = [f for f in report.findings if f.check == "static_addresses"]
    assert {f.reason for f in moved} == {"input batch (needs a static staging buffer)"}
    assert len(moved) == 2 * M and all(f.detail.startswith("aten.copy_") for f in moved), \
        report.describe()
    # ("raise"'s one read of the flags after the window is a .tolist(), below the dispatcher)
    assert report.reasons("no_host_sync") == {"engine/optim/functional.py:_skip": n}, \
        report.describe()


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_version_stashing_schedules_are_refused(schedule: str) -> None:
    """Their version buffers alternate between windows (pb is captured: test_capture_async.py)."""
    with pytest.raises(PipelineConfigError, match=ASYNC_REASON):
        make(schedule)


def test_pb_without_skip_update_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="on_nonfinite='skip_update'"):
        make("pb")


@pytest.mark.parametrize(("kw", "match"), [
    ({"trace": True}, "trace=True"),
    ({"offload_activations": True}, "offload_activations"),
    ({"optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}, "torch.optim.sgd.SGD"),
    ({"optimizer": lambda p: engine.optim.SGD(p, lr=0.1, fused=False)}, "fused=False"),
])
def test_options_that_cannot_be_captured_are_refused(kw, match) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        make("gpipe", **kw)


def test_cpu_stages_without_a_twin_are_refused() -> None:
    with pytest.raises(PipelineConfigError, match="CUDA graphs need CUDA"):
        engine.Pipeline(_stages(), schedule="gpipe", chunks=3, loss_fn=F.mse_loss,
                        optimizer=lambda p: engine.optim.SGD(p, lr=0.1), cuda_graphs="program")


@pytest.mark.parametrize("value", ["yes", 2, "Program"])
def test_bad_values_are_refused(value) -> None:
    with pytest.raises(PipelineConfigError, match="'optimizer'"):
        make("gpipe", value)


def test_true_still_means_the_optimizer_step() -> None:
    with pytest.raises(PipelineConfigError, match="cuda_graphs=True captures each stage's optimizer"):
        make("gpipe", True)
    p = make("gpipe", False)
    assert p.stats()["capture"] == {"mode": "off"}


# ---------------------------------------------------------------------- GPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _gpu(schedule: str, mode: object, width: int = 64, **kw) -> engine.Pipeline:
    torch.manual_seed(0)
    n = 4 if schedule == "interleaved" else 3
    stages = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n - 1)]
    stages.append(nn.Linear(width, 2))
    if schedule == "interleaved":
        kw.setdefault("virtual_stages", 2)
    kw.setdefault("optimizer", lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9))
    return engine.Pipeline(
        [m.cuda() for m in stages], schedule=schedule, chunks=4, loss_fn=F.mse_loss,
        checkpoint="never", cuda_graphs=mode, cuda_streams=False, **kw)


def _gpu_data(n: int, batch: int, width: int = 64, bad: int | None = None):
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for k in range(n):
        x = torch.randn(batch, width, generator=g, device="cuda")
        if k == bad:
            x[0, 0] = float("nan")
        out.append((x, torch.randn(batch, 2, generator=g, device="cuda")))
    return out


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved"])
def test_cuda_captured_equals_eager_bitwise(schedule: str) -> None:
    a, b = _gpu(schedule, "program"), _gpu(schedule, False)
    for x, y in _gpu_data(8, 16):
        assert torch.equal(a.step(x, y), b.step(x, y))
    torch.cuda.synchronize()
    assert same_state(a, b)
    cap = a.stats()["capture"]
    assert cap["captures"] == 1 and cap["replays"] == 5, cap
    assert {k: a.stats()[k] for k in COUNTERS} == {k: b.stats()[k] for k in COUNTERS}


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["sgd", "adamw"])
def test_cuda_a_device_lr_changing_every_step_never_recaptures(family: str) -> None:
    """lr a float32 tensor on the GPU, written in place every step: one capture, then
    replays that read each new value; bitwise eager with the same tensors."""
    def opt(p):
        lr = torch.tensor(0.05, device="cuda")
        if family == "sgd":
            return engine.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=1e-2)
        return engine.optim.AdamW(p, lr=lr, weight_decay=0.1)

    a, b = _gpu("1f1b", "program", optimizer=opt), _gpu("1f1b", False, optimizer=opt)
    for k, (x, y) in enumerate(_gpu_data(8, 16)):
        _write_lrs(a, 0.05 / (1 + k))
        _write_lrs(b, 0.05 / (1 + k))
        assert torch.equal(a.step(x, y), b.step(x, y))
    torch.cuda.synchronize()
    assert same_state(a, b)
    cap = a.stats()["capture"]
    assert cap["captures"] == 1 and cap["replays"] == 5, cap


@pytest.mark.cuda
@cuda
def test_cuda_a_pipeline_lr_scheduler_of_a_device_lr_never_recaptures() -> None:
    """Pipeline(lr_scheduler=...) of a GPU Tensor lr: the scheduler steps after the window,
    one capture, replays reading each new value; bitwise eager."""
    def opt(p):
        return engine.optim.SGD(p, lr=torch.tensor(0.05, device="cuda"), momentum=0.9)

    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k))  # noqa: E731
    a = _gpu("1f1b", "program", optimizer=opt, lr_scheduler=sched)
    b = _gpu("1f1b", False, optimizer=opt, lr_scheduler=sched)
    for x, y in _gpu_data(8, 16):
        assert torch.equal(a.step(x, y), b.step(x, y))
    torch.cuda.synchronize()
    assert same_state(a, b)
    cap = a.stats()["capture"]
    assert cap["captures"] == 1 and cap["replays"] == 5, cap


@pytest.mark.cuda
@cuda
def test_cuda_a_new_shape_recaptures_once_then_replays() -> None:
    a, b = _gpu("1f1b", "program"), _gpu("1f1b", False)
    for x, y in [*_gpu_data(4, 16), *_gpu_data(4, 24), *_gpu_data(2, 16)]:
        assert torch.equal(a.step(x, y), b.step(x, y))
    assert same_state(a, b)
    cap = a.stats()["capture"]
    assert (cap["captures"], cap["replays"]) == (2, 5), cap


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("policy", ["skip", "skip_update", "raise"])
def test_cuda_a_nan_in_a_replay_skips_as_eager(policy: str) -> None:
    a, b = _gpu("1f1b", "program", on_nonfinite=policy), _gpu("1f1b", False, on_nonfinite=policy)
    for k, (x, y) in enumerate(_gpu_data(7, 16, bad=4)):
        if policy == "raise" and k == 4:
            for p in (a, b):
                with pytest.raises(NonFiniteLossError):
                    p.step(x, y)
            continue
        la, lb = a.step(x, y), b.step(x, y)
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))
    torch.cuda.synchronize()
    assert same_state(a, b)
    # "skip_update" counts its skipped update as one (see the CPU test)
    keys = COUNTERS if policy != "skip_update" else ("steps", "skipped_steps", "dropped_microbatches")
    assert {k: a.stats()[k] for k in keys} == {k: b.stats()[k] for k in keys}
    assert a.stats()["capture"]["replays"] >= 3


@pytest.mark.cuda
@cuda
@pytest.mark.usefixtures("sigint_default")
def test_cuda_ctrl_c_during_a_replay_finishes_the_step_then_raises() -> None:
    a, b = _gpu("gpipe", "program"), _gpu("gpipe", False)
    ctrl_c_during_a_replay(a, b, _gpu_data(8, 16))
    torch.cuda.synchronize()
    assert same_state(a, b)
