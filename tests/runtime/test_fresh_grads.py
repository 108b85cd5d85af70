"""engine.runtime.stage.fresh_grads: one multi-tensor add per backward, bit for bit AccumulateGrad."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runtime.stage import fresh_grads as fg
from engine.runtime.stage.fresh_grads import FreshGrads, fresh_grads


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fg, "ON_CPU", True)


def _setup(seed: int = 0):
    """A module whose parameters' .grad are views of one flat buffer (as in the arena), one
    parameter used twice, one unused."""
    torch.manual_seed(seed)
    lin = nn.Linear(5, 5)
    unused = nn.Parameter(torch.randn(3))
    params = [lin.weight, lin.bias, unused]
    flat = torch.zeros(sum(p.numel() for p in params))
    views, off = [], 0
    for p in params:
        v = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
        p.grad = v
        views.append(v)
    return lin, params, flat, views


def _backward(lin: nn.Linear, x: torch.Tensor) -> None:
    y = lin(torch.tanh(lin(x)))  # the weight is used twice: autograd sums before accumulating
    y.pow(2).sum().backward()


@pytest.mark.parametrize("calls", [1, 3])
def test_same_sums_as_accumulate_grad(calls: int) -> None:
    lin_a, params_a, flat_a, views_a = _setup()
    lin_b, params_b, flat_b, views_b = _setup()
    group = FreshGrads(params_b, views_b)
    assert group.enabled
    g = torch.Generator().manual_seed(1)
    for _ in range(calls):
        x = torch.randn(4, 5, generator=g)
        _backward(lin_a, x)
        with fresh_grads([group]):
            _backward(lin_b, x)
            assert all(p.grad is None or p.grad is not v for p, v in zip(params_b, views_b))
        for p, v in zip(params_b, views_b):
            assert p.grad is v  # the views again: the optimizer reads the flat buffer
    assert torch.equal(flat_a, flat_b)
    assert flat_b[-3:].eq(0).all()  # the unused parameter got nothing


def test_a_stale_group_is_written_by_its_first_backward() -> None:
    """After an update the store marks the group stale instead of zeroing (no launch): the
    group's first backward copies its gradients over the old ones and zeroes the views of
    parameters it gave none (the unused one), the second adds. Equal to zeroing first."""
    lin_a, params_a, flat_a, _ = _setup()
    lin_b, params_b, flat_b, views_b = _setup()
    group = FreshGrads(params_b, views_b)
    flat_b.normal_()  # the previous group's gradients, never zeroed
    group.stale = True
    g = torch.Generator().manual_seed(2)
    for k in range(2):
        x = torch.randn(4, 5, generator=g)
        _backward(lin_a, x)
        with fresh_grads([group]):
            _backward(lin_b, x)
        assert not group.stale
        assert torch.equal(flat_a, flat_b), k
    assert flat_b[-3:].eq(0).all()


def test_an_exception_leaves_views_and_what_arrived() -> None:
    lin, params, flat, views = _setup()
    group = FreshGrads(params, views)
    with pytest.raises(RuntimeError, match="boom"), fresh_grads([group]):
        _backward(lin, torch.randn(2, 5))
        raise RuntimeError("boom")
    assert all(p.grad is v for p, v in zip(params, views))
    assert flat.abs().sum() > 0  # accumulated, as AccumulateGrad would have


def test_big_stages_keep_accumulate_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fg, "MAX_BYTES", 8)
    _, params, _, views = _setup()
    group = FreshGrads(params, views)
    assert not group.enabled
    with fresh_grads([group]):
        assert all(p.grad is v for p, v in zip(params, views))


def test_cpu_stages_keep_accumulate_grad_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fg, "ON_CPU", False)
    _, params, _, views = _setup()
    assert not FreshGrads(params, views).enabled


def _train(schedule: str, on_cpu: bool, **kw):
    import torch.nn.functional as F

    import engine
    import engine.optim

    fg.ON_CPU = on_cpu
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)] + [nn.Linear(4, 2)]
    opt_kw = kw.pop("opt", {})
    pipe = engine.Pipeline(stages, schedule=schedule, chunks=3, loss_fn=F.mse_loss,
                           optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9, **opt_kw),
                           **kw)
    assert all(st.store.fresh.enabled == on_cpu for st in pipe.stages)
    g = torch.Generator().manual_seed(3)
    losses = [pipe.step(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(4)]
    pipe.flush()
    return losses, [f.clone() for st in pipe.stages for f in st.store.live_flats()]


@pytest.mark.parametrize(
    ("schedule", "kw"),
    [("1f1b", {}),  # chained backward through every stage
     ("zbh1", {}),  # split B / W
     ("gpipe", {"checkpoint": "always"}),  # recomputation
     ("pipedream", {}),  # stashed versions
     ("pb", {"opt": {"spike_compensation": True, "prediction": "linear"},
             "weight_prediction": "lwp", "update_size": 2})],  # LWP, groups of two
    ids=["1f1b", "zbh1", "gpipe-recompute", "pipedream", "pb-lwp-k2"],
)
def test_pipelines_train_bit_for_bit_as_before(schedule: str, kw: dict) -> None:
    ref = _train(schedule, False, **dict(kw))
    got = _train(schedule, True, **dict(kw))
    for a, b in zip(ref[0] + ref[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)


def _cuda_pipeline(schedule: str, fresh: bool, **kw):
    import torch.nn.functional as F

    import engine
    import engine.demo.models
    import engine.optim

    old = fg.MAX_BYTES
    fg.MAX_BYTES = old if fresh else -1
    try:
        torch.manual_seed(0)
        net = engine.demo.models.residual_mlp(64, 10, layers=8, width=64).cuda()
        layers = list(net.children())
        stages = [nn.Sequential(*layers[2 * s : 2 * s + 2]) for s in range(4)]
        opt_kw = kw.pop("opt", {})
        pipe = engine.Pipeline(stages, schedule=schedule, chunks=4, loss_fn=F.cross_entropy,
                               optimizer=lambda p: engine.optim.SGD(p, lr=1e-2, momentum=0.9, **opt_kw),
                               checkpoint="never", **kw)
    finally:
        fg.MAX_BYTES = old
    assert all(st.store.fresh.enabled == fresh for st in pipe.stages)
    return pipe


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("schedule", "kw"),
    [("1f1b", {}), ("zbh1", {}),
     ("pb", {"opt": {"spike_compensation": True, "prediction": "linear"},
             "weight_prediction": "lwp", "on_nonfinite": "skip_update"})],
    ids=["1f1b", "zbh1", "pb-sc-lwp-skip_update"],
)
def test_cuda_fresh_grads_bitwise_and_fewer_launches(schedule: str, kw: dict) -> None:
    """On a GPU (stage streams on): the same weights bit for bit, and fewer kernel launches
    per step (one multi-tensor add per backward instead of an add_ per parameter)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    fg.ON_CPU = False  # the autouse fixture's CPU switch plays no part on CUDA
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 64, generator=g).cuda(), torch.randint(0, 10, (4,), generator=g).cuda())
            for _ in range(4)]
    launches = {}
    weights = {}
    for fresh in (True, False):
        pipe = _cuda_pipeline(schedule, fresh, **dict(kw))
        for x, y in data[:3]:
            pipe.step(x, y)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            pipe.step(*data[3])
            torch.cuda.synchronize()
        names = Counter(e.name for e in prof.events())
        launches[fresh] = sum(n for k, n in names.items() if "LaunchKernel" in k)
        weights[fresh] = [f.clone() for st in pipe.stages for f in st.store.live_flats()]
    for a, b in zip(weights[True], weights[False], strict=True):
        assert torch.equal(a, b)
    # 4 stages x 4 micro-batches, 2 layers (4-6 parameters) per stage: at least 2 fewer each
    assert launches[True] <= launches[False] - 2 * 16, launches


def _pb_skip_update(on_cpu: bool, update_size: int = 1):
    import torch.nn.functional as F

    import engine
    import engine.optim

    fg.ON_CPU = on_cpu
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)] + [nn.Linear(4, 2)]
    pipe = engine.Pipeline(
        stages, schedule="pb", chunks=3, loss_fn=F.mse_loss, update_size=update_size,
        optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9, spike_compensation=True,
                                             prediction="linear"),
        weight_prediction="lwp", on_nonfinite="skip_update", checkpoint="always")  # (saved unflushed)
    assert all(st.store.fresh.enabled == on_cpu for st in pipe.stages)
    return pipe


def _everything(pipe) -> list[torch.Tensor]:
    out = []
    for st in pipe.stages:
        out += [f.clone() for f in st.store.live_flats()] + st.store.grad_state()
        out += [t for s in st.bridge.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        out.append(st.bridge.skip.state())
    return out


@pytest.mark.parametrize("update_size", [1, 2])
def test_skip_update_and_unflushed_resume_bit_for_bit(update_size: int) -> None:
    """pb + SC + LWP + skip_update, a NaN micro-batch in step 1, the state saved unflushed
    after step 2 and loaded into a new pipeline that goes on: the stale-buffer path (every
    group's first backward writes its gradients and its found_inf) equals zeroing after
    each update -- weights, gradients as they count, optimizer state, flags, losses."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(5)]
    data[1][1][2] = float("nan")  # micro-batch 1 of step 1
    runs = {}
    for on_cpu in (False, True):
        a = _pb_skip_update(on_cpu, update_size)
        losses = [a.step(x, y) for x, y in data[:3]]
        held = a.state_dict()
        assert "in_flight" in held
        b = _pb_skip_update(on_cpu, update_size)
        b.load_state_dict(held)
        losses += [b.step(x, y) for x, y in data[3:]] + [b.flush()]
        losses += [a.step(x, y) for x, y in data[3:]] + [a.flush()]
        runs[on_cpu] = (losses, _everything(a), _everything(b), a.stats()["skipped_updates"])
    ref, got = runs[False], runs[True]
    assert ref[3] == got[3] == [1, 1, 1]  # every stage skipped its NaN group, and only it
    assert any(x is not None and x.isnan() for x in got[0])
    for x, y in zip(ref[0], got[0], strict=True):
        assert (x is None and y is None) or torch.equal(x.view(torch.int32), y.view(torch.int32))
    for x, y in zip(ref[1] + ref[2], got[1] + got[2], strict=True):
        assert torch.equal(x, y)
    fg.ON_CPU = False
