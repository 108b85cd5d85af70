"""engine/runtime/capture/optimizer_graphs.py: CUDA graphs of the stages' optimizer steps.

On CPU the graph itself is replaced by a recorder that, like a CUDA graph, does NOT run the
step at capture and runs it at every replay: the decisions (eager, capture, replay, recapture)
and their bookkeeping are checked against a plain optimizer bit for bit. The real graphs run
in the CUDA-marked tests at the end.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, needs_kernels
from torch import nn

import engine
import engine.optim as eo
from engine import Pipeline, PipelineConfigError
from engine.optim.flat import FlatBinding
from engine.runtime.capture.optimizer_graphs import StepGraphs, launch_key


class Recorder:
    """Stands in for torch.cuda.CUDAGraph: capture records, replay runs."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, step):
        self.captured += 1
        return step


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DEVICE)


def _backward(model: nn.Module, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(4, 5, generator=g).to(DEVICE)
    model(x).square().mean().backward()


def _pair(make_opt):
    """A bound (arena) model stepped through StepGraphs, and the same model stepped plainly."""
    a, b = _model(), _model()
    engine.flatten_(a)
    engine.flatten_(b)
    oa, ob = make_opt(a.parameters()), make_opt(b.parameters())
    rec = Recorder()
    return a, b, oa, ob, StepGraphs(0, oa, rec), rec


def _steps(a, b, oa, ob, graphs, k0, k1, change=None):
    for k in range(k0, k1):
        if change is not None:
            change(k, oa)
            change(k, ob)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=False)  # keep the arena's gradient views
            _backward(m, k)
        graphs.run(lambda: oa.step())
        ob.step()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


SGD_SC_LWP = {"lr": 0.05, "momentum": 0.9, "delay": 2, "spike_compensation": True,
              "prediction": "linear", "fused": True}


@needs_kernels
@pytest.mark.parametrize("make_opt", [
    lambda ps: eo.SGD(ps, **SGD_SC_LWP),
    lambda ps: eo.Adam(ps, lr=1e-2, delay=1, prediction="linear", fused=True),
], ids=["sgd-sc-lwp", "adam-pred"])
def test_capture_after_a_repeat_then_replay_equals_plain_steps(make_opt):
    a, b, oa, ob, graphs, rec = _pair(make_opt)
    _steps(a, b, oa, ob, graphs, 0, 1)
    assert graphs.eager == 1 and "first step" in graphs.reason
    _steps(a, b, oa, ob, graphs, 1, 2)
    assert graphs.eager == 2 and rec.captured == 0  # first steady step: seen, not captured
    _steps(a, b, oa, ob, graphs, 2, 6)
    assert rec.captured == 1 and graphs.replays == 4 and graphs.eager == 2
    assert _same(a, b)  # a capture that also ran the step would have stepped twice
    for p, q in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"], strict=True):
        for key, t in ob.state[q].items():
            assert torch.equal(oa.state[p][key], t), key


@needs_kernels
def test_lr_change_recaptures_and_per_step_changes_stay_eager():
    a, b, oa, ob, graphs, rec = _pair(lambda ps: eo.SGD(ps, **SGD_SC_LWP))
    _steps(a, b, oa, ob, graphs, 0, 4)
    assert rec.captured == 1

    def every_step(k, opt):
        opt.param_groups[0]["lr"] = 0.05 / (k + 1)

    _steps(a, b, oa, ob, graphs, 4, 8, every_step)
    assert rec.captured == 1 and graphs.eager == 2 + 4  # no capture is ever reused: none made
    assert "not seen before" in graphs.reason

    def once(k, opt):
        opt.param_groups[0]["lr"] = 0.003

    _steps(a, b, oa, ob, graphs, 8, 12, once)
    assert rec.captured == 2 and graphs.replays == 2 + 3
    assert _same(a, b)


@needs_kernels
@pytest.mark.parametrize("make_opt", [
    lambda ps, lr: eo.SGD(ps, **dict(SGD_SC_LWP, lr=lr)),
    lambda ps, lr: eo.AdamW(ps, lr=lr, delay=1, prediction="linear", weight_decay=0.1,
                            fused=True),
], ids=["sgd-sc-lwp", "adamw-pred"])
def test_a_device_lr_changing_every_step_is_captured_once(make_opt):
    """lr as a float32 tensor on the params' device (issue 23): the key holds its address,
    not its value, so an LR schedule writing it in place every step never recaptures; the
    steps equal plain steps given the same values as floats, bit for bit."""
    lr = torch.tensor(0.05, device=DEVICE)
    a, b, oa, ob, graphs, rec = _pair(lambda ps: make_opt(ps, 0.05))
    oa.param_groups[0]["lr"] = lr

    def every_step(k, opt):  # float32 values, so the float path sees the tensor's value
        value = float(torch.tensor(0.05 / (k + 1)))
        if opt is oa:
            lr.fill_(value)  # what torch's schedulers do to a Tensor lr
        else:
            opt.param_groups[0]["lr"] = value

    _steps(a, b, oa, ob, graphs, 0, 2, every_step)
    key = launch_key(oa)
    assert isinstance(key, tuple)
    _steps(a, b, oa, ob, graphs, 2, 8, every_step)
    assert rec.captured == 1 and graphs.replays == 6 and graphs.eager == 2, graphs.reason
    assert oa.param_groups[0]["lr"] is lr and launch_key(oa) == key
    assert _same(a, b)
    for p, q in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"], strict=True):
        for name, t in ob.state[q].items():
            assert torch.equal(oa.state[p][name], t), name


@needs_kernels
def test_tensor_option_hooks_and_missing_grads_run_eagerly():
    a, b, oa, ob, graphs, rec = _pair(lambda ps: eo.SGD(ps, **SGD_SC_LWP))
    _steps(a, b, oa, ob, graphs, 0, 3)
    assert graphs.replays == 1
    handle = oa.register_step_pre_hook(lambda *args: None)
    _steps(a, b, oa, ob, graphs, 3, 4)
    assert "hooks" in graphs.reason and graphs.replays == 1
    handle.remove()
    # a Tensor lr the kernels cannot load on the device (float64) is read on the host
    oa.param_groups[0]["lr"] = torch.tensor(0.05, dtype=torch.float64, device=DEVICE)
    assert "is a Tensor the fused kernels cannot read" in launch_key(oa)
    oa.param_groups[0]["lr"] = 0.05
    saved = a[0].bias.grad
    a[0].bias.grad = None  # a parameter without a gradient: not the flat steady state
    assert "flat gradient buffer" in launch_key(oa)
    a[0].bias.grad = saved
    assert isinstance(launch_key(oa), tuple)
    _steps(a, b, oa, ob, graphs, 4, 5)
    assert graphs.replays == 2 and _same(a, b)


@needs_kernels
def test_key_holds_buffers_and_amp_tensors():
    a, _b, oa, _ob, _graphs, _rec = _pair(lambda ps: eo.SGD(ps, **SGD_SC_LWP))
    _backward(a, 0)
    oa.step()
    base = launch_key(oa)
    assert launch_key(oa) == base
    oa.found_inf = torch.zeros(())
    assert launch_key(oa) != base
    del oa.found_inf
    assert launch_key(oa, extra=(1,)) != base
    assert launch_key(oa) == base


@pytest.mark.parametrize("opt, words", [
    (lambda p: torch.optim.SGD(p, lr=0.1), "torch.optim.sgd.SGD"),
    (lambda p: eo.Muon(p, lr=0.1), "Muon"),
    (lambda p: eo.SGD(p, lr=0.1, fused=False), "fused=False"),
    (lambda p: eo.SGD([{"params": p[:1]}, {"params": p[1:], "differentiable": True}], lr=0.1),
     "param group 1: differentiable=True"),
    (lambda p: eo.SGD(p, lr=0.1, momentum=0.9), "stage 0's parameters are on cpu"),
])
def test_refused_before_the_model_moves(opt, words):
    stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
    before = [p.detach().clone() for s in stages for p in s.parameters()]
    with pytest.raises(PipelineConfigError, match="stage 0") as info:
        Pipeline(stages, schedule="pb", chunks=4, loss_fn=nn.functional.mse_loss,
                 optimizer=opt, cuda_graphs=True)
    assert words in str(info.value)
    # nothing moved into an arena: the same modules build a pipeline without graphs
    Pipeline(stages, schedule="pb", chunks=4, loss_fn=nn.functional.mse_loss,
             optimizer=lambda p: eo.SGD(p, lr=0.1))
    after = [p.detach() for s in stages for p in s.parameters()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_option_type_checked():
    with pytest.raises(PipelineConfigError, match="cuda_graphs=1 must be False \\(off\\), 'optimizer'"):
        Pipeline([nn.Linear(4, 2)], schedule="pb", chunks=2, loss_fn=nn.functional.mse_loss,
                 optimizer=lambda p: eo.SGD(p, lr=0.1), cuda_graphs=1)


def test_stats_report_none_when_off():
    pipe = Pipeline([nn.Linear(4, 4), nn.Linear(4, 2)], schedule="pb", chunks=2,
                    loss_fn=nn.functional.mse_loss, optimizer=lambda p: eo.SGD(p, lr=0.1))
    assert pipe.stats()["cuda_graphs"] == [None, None]


# ---------------------------------------------------------------------- on a GPU


def _gpu_run(graphs: bool, make_opt, steps: int = 8, scheduler=None):
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(16, 32), nn.Tanh()).cuda(), nn.Linear(32, 4).cuda()]
    pipe = Pipeline(stages, schedule="pb", chunks=4, loss_fn=nn.functional.mse_loss,
                    optimizer=make_opt, cuda_graphs=graphs, lr_scheduler=scheduler)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16, device="cuda", generator=g)
        pipe.step(x, torch.randn(4, 4, device="cuda", generator=g))
    pipe.flush()
    torch.cuda.synchronize()
    return [p.detach().cpu() for st in pipe.stages for p in st.store.params], pipe.stats()


@pytest.mark.cuda
@pytest.mark.parametrize("make_opt", [
    lambda ps: eo.SGD(ps, lr=0.05, momentum=0.9, spike_compensation=True, prediction="linear"),
    lambda ps: eo.AdamW(ps, lr=1e-3, prediction="linear"),
], ids=["sgd-sc-lwp", "adamw-pred"])
def test_gpu_graph_replays_equal_eager_steps(make_opt):
    eager, _ = _gpu_run(False, make_opt)
    graphed, stats = _gpu_run(True, make_opt)
    assert all(torch.equal(x, y) for x, y in zip(eager, graphed, strict=True))
    assert all(s["replays"] > 0 and s["captures"] >= 1 for s in stats["cuda_graphs"])


@pytest.mark.cuda
def test_gpu_per_step_schedule_of_a_device_lr_replays():
    """The same schedule with lr a float32 tensor on the stage's device: captured once per
    stage, replayed every later step, bitwise the eager run (the kernels load the lr the
    scheduler wrote after each replay)."""
    make = lambda ps: eo.SGD(ps, lr=torch.tensor(0.05, device="cuda"), momentum=0.9)  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9)  # noqa: E731
    eager, _ = _gpu_run(False, make, scheduler=sched)
    graphed, stats = _gpu_run(True, make, scheduler=sched)
    assert all(torch.equal(x, y) for x, y in zip(eager, graphed, strict=True))
    # (the float-lr schedule below never replays; a weight store may keep a graph per buffer)
    assert all(1 <= s["captures"] <= 2 and s["replays"] > 0 for s in stats["cuda_graphs"]), stats


@pytest.mark.cuda
def test_gpu_per_step_lr_schedule_stays_eager():
    make = lambda ps: eo.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9)  # noqa: E731
    eager, _ = _gpu_run(False, make, scheduler=sched)
    graphed, stats = _gpu_run(True, make, scheduler=sched)
    assert all(torch.equal(x, y) for x, y in zip(eager, graphed, strict=True))
    assert all(s["replays"] == 0 for s in stats["cuda_graphs"])


@needs_kernels
def test_group_over_several_buckets_runs_eagerly():
    """Mixed dtypes make two buckets in one group: one multi-tensor launch whose pointer table
    is rebuilt when a buffer changes, so no graph may hold on to it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3).to(torch.bfloat16)).to(DEVICE)
    arena = engine.flatten_(model)
    opt = eo.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    views = [arena.flat_view(b) for b in range(len(arena.buckets))]
    opt.bind_flat([FlatBinding(view=v, params=tuple(v.params)) for v in views])  # as a stage
    for p in model.parameters():
        p.grad.copy_(torch.randn_like(p))
    opt.step()
    assert len(opt._group_bindings(0, opt.param_groups[0])) == 2
    assert "2 flat buckets" in launch_key(opt)
