"""The PyTorch facts the runtime's weight handling relies on, checked experimentally, and the
WeightStore built on them (live views, retiring a pinned version without a copy per
micro-batch, the transient, saved-weight remapping)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.arena import flatten_
from engine.runtime.stage import labels
from engine.runtime.stage.saved_weights import SavedWeights
from engine.runtime.stage.weight_store import LIVE, WeightStore
from engine.testing import Probe


def _setup() -> tuple[nn.Module, WeightStore]:
    torch.manual_seed(0)
    model = nn.Sequential(Probe(3, init=2.0), nn.Linear(3, 2))
    params = list(model.parameters())
    arena = flatten_(model)
    shadow = [nn.Parameter(p.data, requires_grad=p.requires_grad) for p in params]
    return model, WeightStore(arena, params, shadow)


def _act(stage: int, mb: int, kind: str) -> None:
    labels.CURRENT = (stage, mb, kind)


def test_parameters_and_shadows_are_views_of_one_flat_buffer() -> None:
    model, store = _setup()
    (flat,) = store.live_flats()
    assert flat.numel() >= 3 + 6 + 2
    for p, sp in zip(model.parameters(), store.shadow, strict=True):
        assert p.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert sp.data_ptr() == p.data_ptr() and sp.grad is p.grad


def test_saved_leaf_reads_current_data_builtin_view_keeps_forward_storage() -> None:
    """Fact 1: a custom Function's saved leaf param is read at B time through param.data; a
    builtin op's saved view (Linear saves weight.t()) keeps the storage F ran on. So B must run
    under the storage F used (``use(buffer)``) for both to agree."""
    model, store = _setup()
    slot = store.transient_buffer()
    for dst, src in zip(store.flats(slot), store.live_flats(), strict=True):
        dst.copy_(src * 10)
    x = torch.randn(4, 3, requires_grad=True)
    try:
        _act(0, 0, "F")
        with store.use(slot):
            y = model(x).sum()
        with torch.no_grad():
            store.live_flats()[0].add_(1.0)  # live changes after F (no version bump)
        _act(0, 0, "B")
        y.backward()  # B outside the slot: the probe reads LIVE, Linear reads the slot
        probe = model[0]
        f_val, b_val = probe.log[0]["value"], probe.log[1]["value"]
        assert torch.equal(f_val, torch.full((3,), 20.0))
        assert torch.equal(b_val, store.views(LIVE)[0])  # the probe read the *live* weights
        probe.log.clear()
        _act(0, 1, "F")
        with store.use(slot):
            y = model(x).sum()
        _act(0, 1, "B")
        with store.use(slot):
            y.backward()
        assert torch.equal(probe.log[0]["value"], probe.log[1]["value"])
    finally:
        labels.CURRENT = None


def test_version_counter_writes_through_other_tensors_do_not_bump() -> None:
    """Fact 2: writing through the flat buffer or p.data, or assigning p.data, leaves the
    parameter's version counter alone; an in-place op on the Parameter bumps it and a later
    backward raises. Hence the optimizer steps shadow parameters or the flat buffers."""
    model, store = _setup()
    w = model[1].weight
    v0 = w._version
    store.live_flats()[0].mul_(1.5)
    w.data.add_(1.0)
    with store.use(store.transient_buffer()):
        pass
    assert w._version == v0
    y = model(torch.randn(2, 3)).sum()
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    y = model(torch.randn(2, 3)).sum()
    with torch.no_grad():
        store.shadow[1].add_(1.0)  # Linear.weight's shadow
    assert torch.equal(store.shadow[1], w)
    y.backward()  # fine


def test_retiring_a_pinned_version_moves_no_bytes_per_microbatch() -> None:
    """A forward pins live; before the optimizer writes, the store retires it (copy into a
    pooled slot, O(1) swap): the forward's saved views keep the old version, the new live is
    a copy the optimizer may overwrite, and the slot is pooled again at its last release."""
    model, store = _setup()
    lin = model[1]
    x = torch.randn(4, 3)
    pin = store.pin_version(0, mb=7)
    y = lin(x).sum()  # saves weight.t(): a view of the live memory
    old = lin.weight.detach().clone()
    old_ptr = lin.weight.data_ptr()
    store.before_update(keep_live=False)
    assert store.versions_held == 2 and store.retirements == 1
    assert lin.weight.data_ptr() != old_ptr  # the module now views the fresh live copy
    assert store.shadow[1].data_ptr() == lin.weight.data_ptr()
    with torch.no_grad():
        store.live_flats()[0].add_(5.0)  # "the optimizer step"
    store.finish_update(None)
    buf = store.resolve(pin)
    assert buf != LIVE
    with store.use(buf):
        assert torch.equal(lin.weight, old)
        y.backward()
    assert torch.allclose(lin.weight.grad, torch.ones(2, 1) * x.sum(0))
    store.release(pin, mb=7)
    assert store.versions_held == 1
    assert store.bytes()["pooled"] > 0  # the slot's buffers went back to the arena's pool
    pin2 = store.pin_version(1, mb=8)
    store.before_update(keep_live=False)
    assert store.bytes()["pooled"] == 0  # and were reused
    store.release(pin2, mb=8)


def test_two_bw_keeps_exactly_two_versions() -> None:
    _, store = _setup()
    for t in range(6):
        store.before_update(keep_live=True)  # future forwards read the version being replaced
        store.finish_update(None)
        assert store.versions_held == 2, t
        store.pin_version(t + 1, mb=t)  # the next mini-batch reads the new version...
        store.release(("v", t + 1), mb=t)
    assert store.peak_versions == 2


def test_transient_is_filled_once_per_update() -> None:
    _, store = _setup()
    calls = []

    def fill(buf: int) -> None:
        calls.append(buf)
        for dst, src in zip(store.flats(buf), store.live_flats(), strict=True):
            dst.copy_(src + 1)

    a = store.transient(("predict", None), 0, fill)
    b = store.transient(("predict", None), 0, fill)
    assert a == b and len(calls) == 1
    store.transient(("predict", 2.0), 0, fill)
    assert len(calls) == 2
    store.finish_update(("predict", None))  # the fused step wrote the default prediction
    store.transient(("predict", None), 1, fill)
    assert len(calls) == 2
    assert store.buffers_held == 2  # live + the transient


def test_saved_weights_resolve_to_the_backward_buffer() -> None:
    """checkpoint="never" with LWP: the forward ran on the prediction; its saved views of the
    weights resolve to the live buffer when the backward runs (no copy kept per micro-batch)."""
    model, store = _setup()
    lin = model[1]
    saved = SavedWeights(store)
    t = store.transient_buffer()
    for dst, src in zip(store.flats(t), store.live_flats(), strict=True):
        dst.copy_(src * 3)
    x = torch.randn(5, 3, requires_grad=True)
    with store.use(t), saved.packing(t):
        y = lin(x).sum()
    for dst in store.flats(t):
        dst.fill_(float("nan"))  # the transient is overwritten (the next prediction)
    with saved.unpacking(LIVE):
        y.backward()
    expect = torch.ones(5, 2) @ lin.weight.detach()  # grad wrt x uses the *live* weights
    assert torch.allclose(x.grad, expect)
