"""The PyTorch facts the runtime's weight handling relies on, checked experimentally, and the
WeightStore built on them (pins, holds, pooling, ``use``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runtime import Probe
from engine.runtime.probe import action_context
from engine.runtime.weights import LIVE, WeightStore


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(Probe(3, init=2.0), nn.Linear(3, 2))
    store = WeightStore(model)
    return model, store


def test_parameters_become_views_of_one_flat_buffer() -> None:
    model, store = _setup()
    flat = store._buffers[LIVE][0]
    assert flat.numel() == 3 + 6 + 2
    for p in model.parameters():
        assert p.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_saved_leaf_reads_current_data_builtin_view_keeps_forward_storage() -> None:
    """Fact 1: a custom Function's saved leaf param is read at B time through param.data; a
    builtin op's saved view (Linear saves weight.t()) keeps the storage F ran on. So B must run
    under the storage F used (use(slot)) for both to agree."""
    model, store = _setup()
    slot = store.snapshot()
    store.write(slot, [v * 10 for v in store.views(LIVE)])
    x = torch.randn(4, 3, requires_grad=True)
    with action_context(0, 0, "F"), store.use(slot):
        y = model(x).sum()
    with torch.no_grad():
        store._buffers[LIVE][0].add_(1.0)  # live changes after F (no version bump)
    with action_context(0, 0, "B"):
        y.backward()  # B outside the slot: the probe reads LIVE, Linear reads the slot
    probe = model[0]
    f_val, b_val = probe.log[0]["value"], probe.log[1]["value"]
    assert torch.equal(f_val, torch.full((3,), 20.0))
    assert torch.equal(b_val, store.views(LIVE)[0])  # the probe read the *live* weights
    # with B under the same slot, both agree
    probe.log.clear()
    x.grad = None
    with action_context(0, 1, "F"), store.use(slot):
        y = model(x).sum()
    with action_context(0, 1, "B"), store.use(slot):
        y.backward()
    assert torch.equal(probe.log[0]["value"], probe.log[1]["value"])


def test_version_counter_writes_through_other_tensors_do_not_bump() -> None:
    """Fact 2: writing through the flat buffer or p.data, or assigning p.data, leaves the
    parameter's version counter alone; an in-place op on the Parameter bumps it and a later
    backward raises. Hence the optimizer steps shadow parameters."""
    model, store = _setup()
    w = model[1].weight
    v0 = w._version
    store._buffers[LIVE][0].mul_(1.5)
    w.data.add_(1.0)
    slot = store.snapshot()
    with store.use(slot):
        pass
    assert w._version == v0
    y = model(torch.randn(2, 3)).sum()
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # shadow params share the storage but not the version counter
    y = model(torch.randn(2, 3)).sum()
    shadow = store.optimizer_params()
    with torch.no_grad():
        shadow[1].add_(1.0)  # Linear.weight's shadow
    assert torch.equal(shadow[1], w)
    y.backward()  # fine


def test_pins_holds_and_pool() -> None:
    _, store = _setup()
    a = store.snapshot(version=0)
    store.pin(a, 1)
    store.pin(a, 2)
    store.hold(a, "2bw")
    assert store.find_version(0) == a
    store.release(a, 1)
    store.release(a, 2)
    assert a in store.slots
    store.unhold(a, "2bw")
    assert store.slots == [] and len(store._pool) == 1
    b = store.snapshot(version=1)
    assert store._pool == []  # reused
    assert store.versions_held(live_version=2) == 2
    assert store.bytes() == 2 * 11 * 4
    store.pin(b, 0)
    with store.use(b):
        with pytest.raises(RuntimeError, match="in use"):
            store.release(b, 0)


@pytest.mark.parametrize(
    "schedule,kw",
    [
        ("1f1b", {}),
        ("pipedream", {}),
        ("2bw", {}),
        ("pb", {}),
        ("pb", {"prediction": "lwp"}),
        ("pb", {"prediction": "spectrain"}),
        ("pb", {"discrepancy_correction": True}),
    ],
)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_arena_and_torch_backends_agree_bitwise(schedule: str, kw: dict, checkpoint: str) -> None:
    """The C++ WeightArena backend and the plain-torch backend run the same policy."""
    pytest.importorskip("engine._C")
    from engine.runtime import Pipeline

    results = []
    for backend in ("arena", "torch"):
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(2)] + [nn.Linear(3, 1)]
        pipe = Pipeline(
            stages,
            schedule=schedule,
            chunks=3,
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            checkpoint=checkpoint,
            weights=backend,
            **kw,
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            pipe.step(torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g))
        pipe.flush()
        st = pipe.stats()
        assert all(s.store.slots == [] for s in pipe.stages)
        results.append(
            (
                [p.detach().clone() for s in stages for p in s.parameters()],
                st["weight_versions"],
                st["measured_delays"],
            )
        )
    (wa, va, da), (wt, vt, dt) = results
    assert all(torch.equal(a, b) for a, b in zip(wa, wt, strict=True))
    assert va == vt and da == dt
