"""A stage's optimizer steps the arena's flat buffers: one update call per bucket, the buckets
follow the optimizer's param groups, and the result equals the per-tensor path bit for bit
(CPU, reference path).

The runtime hands each stage optimizer its flat buffers explicitly
(``DelayOptimizer.bind_flat``): no registry lookups, no gradient copies per step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine._C  # noqa: F401  (the extension: a broken build fails, it does not skip)
import engine.optim as eo
from engine import Pipeline
from engine.arena import flat_buffers_for


S, M = 3, 4


def _stages() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5)) for _ in range(S)]


def _run(schedule: str, opt, *, flat: bool = True, steps: int = 4, **kw):
    pipe = Pipeline(
        _stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss, optimizer=opt, **kw
    )
    calls = [0] * S
    for st in pipe.stages:
        if not flat:
            st.optimizer.bind_flat([])  # unbound: the per-tensor path
        orig = st.optimizer._call_update

        def counted(*a, _s=st.index, _orig=orig, **k):
            calls[_s] += 1
            return _orig(*a, **k)

        st.optimizer._call_update = counted
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pipe.step(torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g))
    pipe.flush()
    params = [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]
    return pipe, calls, params


OPTS = {
    "sgd": lambda p: eo.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, fused=False),
    "adam": lambda p: eo.Adam(p, lr=1e-2, fused=False),
    "sgd_sc": lambda p: eo.SGD(p, lr=0.05, momentum=0.9, spike_compensation=True, fused=False),
}


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("schedule", ["gpipe", "pipedream", "2bw", "pb"])
def test_one_call_per_bucket_and_bitwise_equal(schedule: str, opt: str) -> None:
    if opt == "sgd_sc" and schedule == "gpipe":
        pytest.skip("spike compensation is refused on synchronous schedules (no delay)")
    pipe, calls, flat = _run(schedule, OPTS[opt])
    _, calls_t, per_tensor = _run(schedule, OPTS[opt], flat=False)
    updates = [st.updates for st in pipe.stages]
    # one bucket per stage (one dtype, one group): one update call per optimizer step
    for st in pipe.stages:
        assert len(st.store.arena.buckets) == 1
    assert calls == updates
    # the per-tensor path calls once per parameter (4 per stage)
    assert calls_t == [4 * u for u in updates]
    for a, b in zip(flat, per_tensor, strict=True):
        assert torch.equal(a, b)


def test_param_groups_become_buckets() -> None:
    """No weight decay on biases: two groups, two buckets, two calls per update."""

    def opt(params):
        decay = [p for p in params if p.dim() > 1]
        rest = [p for p in params if p.dim() <= 1]
        return eo.AdamW(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, fused=False
        )

    pipe, calls, flat = _run("1f1b", opt)
    _, calls_t, per_tensor = _run("1f1b", opt, flat=False)
    for st in pipe.stages:
        assert len(st.store.arena.buckets) == 2
        assert [b.group for b in st.store.arena.buckets] == [0, 1]
    assert calls == [2 * st.updates for st in pipe.stages]
    for a, b in zip(flat, per_tensor, strict=True):
        assert torch.equal(a, b)


def test_flat_buffers_are_handed_over_not_looked_up() -> None:
    pipe, _, _ = _run("gpipe", OPTS["sgd"], steps=1)
    st = pipe.stages[0]
    (binding,) = st.optimizer._bindings[0]
    assert binding.view is st.store.arena.flat_view(0)
    assert binding.params == tuple(st.store.shadow)
    assert flat_buffers_for(st.store.shadow) is None  # no storage-alias registry any more
    # gradients live in the flat buffer for the stage's life (no copy, no allocation)
    grads = [p.grad for p in st.module.parameters()]
    flat_grad = st.store.arena.flat_grad(0)
    assert all(g.untyped_storage().data_ptr() == flat_grad.untyped_storage().data_ptr() for g in grads)


def test_steady_steps_check_the_gradients_once(monkeypatch) -> None:
    """In the steady state a bound group's gradients are checked once per step (one C-level
    pass in _check_before_step), not again by the update; a replaced .grad leaves the steady
    state and the step still equals the per-tensor path."""
    import engine
    from engine.optim.flat import FlatBinding

    def model() -> nn.Module:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5))

    a, b = model(), model()
    engine.flatten_(a)
    oa = eo.SGD(a.parameters(), lr=0.1, momentum=0.9, spike_compensation=True, delay=2)
    ob = eo.SGD(b.parameters(), lr=0.1, momentum=0.9, spike_compensation=True, delay=2)
    calls = []
    real = FlatBinding.grads_in_buffer
    monkeypatch.setattr(FlatBinding, "grads_in_buffer", lambda self: calls.append(1) or real(self))
    x = torch.randn(3, 5)
    for k in range(4):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=False)
            m(x * (k + 1)).square().mean().backward()
        if k == 2:  # a fresh gradient tensor: not the flat buffer's view any more
            a[0].weight.grad = a[0].weight.grad.clone()
        calls.clear()
        oa.step()
        ob.step()
        assert len(calls) == (1 if k != 2 else 2), k  # step 2: checked, then rebound
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
