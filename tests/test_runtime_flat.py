"""A flattened stage is updated with one optimizer call per arena bucket, and the result equals
the per-tensor path bit for bit (CPU, reference path).

The pipeline hands its stage optimizers *shadow* Parameters that share the arena's live
storage (so an update never bumps the module Parameters' autograd version counters);
``engine.arena.flat_buffers_for`` recognises them by storage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine.arena import flat_buffers_for
from engine.runtime import Pipeline

pytest.importorskip("engine._C")

S, M = 3, 4


def _stages() -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5)) for _ in range(S)]


def _run(schedule: str, weights: str, opt, steps: int = 4, **kw):
    pipe = Pipeline(
        _stages(),
        schedule=schedule,
        chunks=M,
        loss_fn=nn.functional.mse_loss,
        optimizer=opt,
        weights=weights,
        **kw,
    )
    calls = [0] * S
    for st in pipe.stages:
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
@pytest.mark.parametrize("schedule", ["gpipe", "pipedream", "pb"])
def test_one_call_per_bucket_and_bitwise_equal(schedule: str, opt: str) -> None:
    pipe, calls, flat = _run(schedule, "arena", OPTS[opt])
    _, calls_t, per_tensor = _run(schedule, "torch", OPTS[opt])
    updates = [st.updates for st in pipe.stages]
    # one bucket per stage (one dtype, one group): one update call per optimizer step
    for st in pipe.stages:
        assert len(st.store.arena.buckets) == 1
    assert calls == updates
    # the per-tensor path calls once per parameter (4 per stage)
    assert calls_t == [4 * u for u in updates]
    for a, b in zip(flat, per_tensor, strict=True):
        assert torch.equal(a, b)


def test_flat_buffers_for_accepts_storage_aliases_only() -> None:
    pipe, _, _ = _run("gpipe", "arena", OPTS["sgd"], steps=1)
    st = pipe.stages[0]
    shadow = st.shadow
    fv = flat_buffers_for(shadow)
    assert fv is not None and fv.params == tuple(shadow)
    assert fv.param.data_ptr() == st.store.arena.flat_param(0).data_ptr()
    assert flat_buffers_for(shadow) is fv  # cached per tuple of tensors
    assert flat_buffers_for(shadow[:2]) is None  # a subset
    assert flat_buffers_for(shadow[::-1]) is None  # another order
    clones = [nn.Parameter(p.detach().clone()) for p in shadow]
    assert flat_buffers_for(clones) is None  # same values, other storage
    wrong_shape = [nn.Parameter(shadow[0].detach().view(-1))] + shadow[1:]
    assert flat_buffers_for(wrong_shape) is None
