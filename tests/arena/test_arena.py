"""Tests of the weight arena (engine.arena over engine._C).

The arena is the foundation every later piece (fused optimizers, weight stashing, 2BW,
weight prediction) builds on, so these tests pin down the contract: aligned slices,
aliasing between parameters and flat buffers, bit-exact independent snapshots,
reference-counted slots, copy-free rotation, unchanged module behaviour, and bad input
rejected before anything moves.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from engine.arena import (
    ArenaError,
    FlatView,
    SlotError,
    WeightArena,
    flat_buffers_for,
    flatten_,
)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))


def clones(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor], ptrs: dict[str, int]) -> None:
    for n, p in module.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert p.data_ptr() == ptrs[n], f"{n} was moved"


def data_ptrs(module: nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("alignment", [256, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_slice_is_aligned_and_padding_is_zero(alignment: int, dtype: torch.dtype) -> None:
    m = mlp().to(dtype)
    before = clones(m)
    arena = flatten_(m, alignment=alignment)
    for p in m.parameters():
        assert p.data_ptr() % alignment == 0
        assert p.grad is not None and p.grad.data_ptr() % alignment == 0
    (bucket,) = arena.buckets
    assert bucket.numel * p.element_size() % alignment == 0
    assert bucket.nbytes == bucket.numel * p.element_size()
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n])
    flat = arena.flat_param()
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    for off, n in zip(bucket.offsets, bucket.numels, strict=False):
        mask[off : off + n] = False
    assert mask.any()  # this layout has padding
    assert torch.count_nonzero(flat[mask]) == 0
    # padding stays zero through a forward/backward and an SGD step over the whole buffer
    m(torch.randn(5, 7, dtype=dtype)).square().sum().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt.step()
    fv = flat_buffers_for(list(m.parameters()))
    assert fv is not None
    fv.param.add_(fv.grad, alpha=-0.1)  # a "one launch" update sweeping the padding too
    assert torch.count_nonzero(flat[mask]) == 0
    assert torch.count_nonzero(arena.flat_grad()[mask]) == 0


def test_non_power_of_two_alignment_is_rejected_and_nothing_moves() -> None:
    m = mlp()
    before, ptrs = clones(m), data_ptrs(m)
    for bad in (0, 3, 100, -256, 2.0):
        with pytest.raises(ArenaError, match="power of two"):
            flatten_(m, alignment=bad)  # type: ignore[arg-type]
    assert_unchanged(m, before, ptrs)
    assert flat_buffers_for(list(m.parameters())) is None


def test_buckets_split_by_dtype_group_and_requires_grad() -> None:
    a = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.randn(4, dtype=torch.float64))
    c = nn.Parameter(torch.randn(5), requires_grad=False)
    d = nn.Parameter(torch.randn(2))
    arena = flatten_([{"params": [a, b, c]}, {"params": [d]}])
    keys = [(x.dtype, x.group, x.requires_grad) for x in arena.buckets]
    assert keys == [
        (torch.float32, 0, True),
        (torch.float64, 0, True),
        (torch.float32, 0, False),
        (torch.float32, 1, True),
    ]
    assert arena.params == [a, b, c, d]
    assert arena.names[3] == "param_groups[1].params[0]"


# ----------------------------------------------------------------------------- aliasing


def test_param_and_grad_views_alias_the_flat_buffers() -> None:
    m = mlp()
    arena = flatten_(m)
    (bucket,) = arena.buckets
    flat, gflat = arena.flat_param(), arena.flat_grad()
    assert gflat is not None
    w = m[0].weight
    off = bucket.offsets[0]
    # write through the parameter, read through the flat buffer
    with torch.no_grad():
        w[2, 3] = 42.0
    assert flat[off + 2 * 7 + 3].item() == 42.0
    # write through the flat buffer, read through the parameter
    flat[bucket.offsets[3] + 1] = -7.0
    assert m[2].bias[1].item() == -7.0
    gflat[off + 5] = 3.5
    assert w.grad.view(-1)[5].item() == 3.5
    w.grad.view(-1)[6] = 1.25
    assert gflat[off + 6].item() == 1.25


def test_module_keeps_working_and_grads_land_in_the_flat_buffer() -> None:
    ref, m = mlp(1), mlp(1)
    params = list(m.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)  # created BEFORE flattening
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    arena = flatten_(m)
    assert list(m.parameters()) == params and all(a is b for a, b in zip(m.parameters(), params, strict=False))
    torch.manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 7), torch.randn(8, 3)
        for model, o in ((ref, ref_opt), (m, opt)):
            o.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=False):
        assert torch.equal(p, q), n
    (bucket,) = arena.buckets
    gflat = arena.flat_grad()
    for p, off, n in zip(m.parameters(), bucket.offsets, bucket.numels, strict=False):
        assert torch.equal(gflat[off : off + n], p.grad.reshape(-1))
        assert p.grad.data_ptr() == gflat[off:].data_ptr()
    # arena.zero_grad keeps the views
    ptrs = [p.grad.data_ptr() for p in m.parameters()]
    arena.zero_grad()
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    assert torch.count_nonzero(gflat) == 0


def test_existing_grads_are_copied_in() -> None:
    m = mlp()
    m(torch.randn(2, 7)).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    arena = flatten_(m)
    for p, g in zip(m.parameters(), grads, strict=False):
        assert torch.equal(p.grad, g)
    assert flat_buffers_for(arena.params).grads_are_views()


def test_state_dict_round_trips_before_and_after_flattening() -> None:
    src = mlp(5)
    saved_before = io.BytesIO()
    torch.save(src.state_dict(), saved_before)

    m = mlp(6)
    flatten_(m)
    saved_before.seek(0)
    m.load_state_dict(torch.load(saved_before))
    for p, q in zip(m.parameters(), src.parameters(), strict=False):
        assert torch.equal(p, q)
    assert flat_buffers_for(list(m.parameters())) is not None  # still views after loading

    with torch.no_grad():
        m[0].weight.mul_(2)
    saved_after = io.BytesIO()
    torch.save(m.state_dict(), saved_after)
    plain = mlp(7)
    saved_after.seek(0)
    plain.load_state_dict(torch.load(saved_after))
    for p, q in zip(plain.parameters(), m.parameters(), strict=False):
        assert torch.equal(p, q)
        assert p.shape == q.shape


def test_requires_grad_false_params_stay_out_of_the_grad_buffer() -> None:
    m = mlp()
    m[0].weight.requires_grad_(False)
    arena = flatten_(m)
    frozen = [b for b in arena.buckets if not b.requires_grad]
    assert len(frozen) == 1 and frozen[0].names == ("0.weight",)
    assert arena.flat_grad(frozen[0].index) is None
    assert m[0].weight.grad is None
    m(torch.randn(4, 7)).sum().backward()
    assert m[0].weight.grad is None
    assert m[0].bias.grad is not None
    trainable = [p for p in m.parameters() if p.requires_grad]
    fv = flat_buffers_for(trainable)
    assert fv is not None and fv.grad is not None and fv.grads_are_views()
    fv_frozen = flat_buffers_for([m[0].weight])
    assert fv_frozen is not None and fv_frozen.grad is None
    total = sum(b.nbytes for b in arena.buckets)
    grad_total = sum(b.nbytes for b in arena.buckets if b.requires_grad)
    assert arena.bytes()["live"] == total and arena.bytes()["grad"] == grad_total


def test_zero_size_params_work() -> None:
    empty = nn.Parameter(torch.empty(0, 4))
    w = nn.Parameter(torch.randn(3, 4))
    arena = flatten_([empty, w])
    assert empty.shape == (0, 4) and empty.numel() == 0
    assert w.data_ptr() % 256 == 0
    (w * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3, 4), 2.0))
    s = arena.snapshot()
    views = arena.slot_views(s)
    assert views[0].shape == (0, 4) and torch.equal(views[1], w.detach())
    fv = flat_buffers_for([empty, w])
    assert fv is not None and fv.numels == [0, 12]


# ----------------------------------------------------------------------------- slots


def test_snapshot_is_bit_exact_and_independent() -> None:
    m = mlp()
    arena = flatten_(m)
    live = [p.detach().clone() for p in m.parameters()]
    s = arena.snapshot()
    views = arena.slot_views(s)
    assert len(views) == len(live)
    for v, w in zip(views, live, strict=False):
        assert v.dtype == w.dtype and v.shape == w.shape
        assert torch.equal(v.view(torch.int32), w.view(torch.int32))  # bit for bit
        assert v.data_ptr() % 256 == 0
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    for v, w in zip(arena.slot_views(s), live, strict=False):
        assert torch.equal(v, w)
    assert torch.equal(arena.slot_flat(s)[: arena.buckets[0].numel].count_nonzero(),
                       torch.cat([w.reshape(-1) for w in live]).count_nonzero())
    # use() runs the module on the slot and returns to the live weights
    x = torch.randn(3, 7)
    ref = mlp()(x)
    with arena.use(s):
        assert torch.equal(m(x), ref)
        assert flat_buffers_for(arena.params) is None  # not the live buffer right now
    assert torch.equal(m[0].bias, live[1] + 1.0)
    assert flat_buffers_for(arena.params) is not None
    arena.restore(s)
    for p, w in zip(m.parameters(), live, strict=False):
        assert torch.equal(p, w)
    assert flat_buffers_for(arena.params) is not None  # restore copies, params stay views


def test_refcounted_release_frees_the_slot() -> None:
    arena = flatten_(mlp())
    per = arena.bytes()["live"]
    s = arena.snapshot(microbatch=0)
    arena.pin(s, 1)
    arena.pin(s, 1)
    assert arena.refcount(s) == 3 and arena.pins(s) == {0: 1, 1: 2}
    assert arena.bytes()["slots"] == per and arena.bytes()["per_slot"] == {s: per}
    assert arena.release(s, 0) is False
    assert arena.release(s, 1) is False
    assert s in arena.slots and arena.bytes()["slots"] == per
    assert arena.release(s, 1) is True
    assert s not in arena.slots
    b = arena.bytes()
    assert b["slots"] == 0 and b["per_slot"] == {}
    assert b["peak"] == b["live"] + b["grad"] + per


def test_release_of_unknown_or_freed_slot_is_a_clear_error() -> None:
    arena = flatten_(mlp(), name="stage3")
    s = arena.snapshot(microbatch=4)
    with pytest.raises(SlotError, match="stage3.*no weight slot 99"):
        arena.release(99, 4)
    with pytest.raises(SlotError, match="not pinned to micro-batch 5"):
        arena.release(s, 5)
    assert arena.pins(s) == {4: 1}  # failed releases changed nothing
    assert arena.release(s, 4) is True
    with pytest.raises(SlotError, match="already freed"):
        arena.release(s, 4)
    with pytest.raises(SlotError, match="already freed"):
        arena.slot_views(s)
    unpinned = arena.snapshot()
    arena.free(unpinned)
    with pytest.raises(SlotError, match="already freed"):
        arena.free(unpinned)


# ----------------------------------------------------------------------------- slot pool


def padding_mask(arena: WeightArena, bucket: int = 0) -> torch.Tensor:
    info = arena.buckets[bucket]
    mask = torch.ones(info.numel, dtype=torch.bool)
    for off, n in zip(info.offsets, info.numels, strict=True):
        mask[off : off + n] = False
    return mask


def test_freed_slot_buffers_are_pooled_and_reused() -> None:
    m = mlp()
    arena = flatten_(m)
    per = arena.bytes()["live"]
    s = arena.snapshot(microbatch=0)
    first = arena.slot_flat(s).data_ptr()
    assert arena.release(s, 0) is True
    b = arena.bytes()
    assert b["slots"] == 0 and b["per_slot"] == {} and b["pooled"] == per
    with torch.no_grad():
        m[0].weight.add_(1.0)
    t = arena.snapshot()  # served from the pool: the same memory, the current live values
    assert arena.slot_flat(t).data_ptr() == first
    assert torch.equal(arena.slot_flat(t), arena.flat_param())
    b = arena.bytes()
    assert b["pooled"] == 0 and b["slots"] == per
    assert b["peak"] == b["live"] + b["grad"] + per  # the pool never counts towards the peak
    arena.free(t)
    assert arena.trim_pool() == per
    assert arena.bytes()["pooled"] == 0 and arena.trim_pool() == 0


def test_pool_never_holds_more_than_the_peak() -> None:
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(torch.randn(3, dtype=torch.float64))
    c = nn.Parameter(torch.randn(7), requires_grad=False)
    arena = flatten_([a, b, c])
    per = arena.bytes()["live"]
    slots = [arena.snapshot(microbatch=i) for i in range(3)]
    for i, s in enumerate(slots):
        arena.release(s, i)
    by = arena.bytes()
    assert by["pooled"] == 3 * per and by["slots"] == 0
    for _ in range(5):  # steady state: two versions at a time, nothing new allocated
        x, y = arena.snapshot(), arena.new_slot()
        by = arena.bytes()
        assert by["pooled"] == per and by["slots"] == 2 * per
        assert by["live"] + by["grad"] + by["slots"] + by["pooled"] <= by["peak"]
        for bucket in range(len(arena.buckets)):  # every pooled set fits every bucket
            assert torch.equal(arena.slot_flat(x, bucket), arena.flat_param(bucket))
        arena.free(x)
        arena.free(y)
    assert arena.bytes()["peak"] == arena.bytes()["live"] + arena.bytes()["grad"] + 3 * per
    assert arena.trim_pool() == 3 * per


def test_new_slot_reuses_without_copy_or_fill_and_keeps_padding_zero() -> None:
    m = mlp()
    arena = flatten_(m)
    mask = padding_mask(arena)
    fresh = arena.new_slot()  # nothing pooled yet: allocated, zeroed once
    assert torch.count_nonzero(arena.slot_flat(fresh)[mask]) == 0
    with torch.no_grad():
        for v in arena.slot_views(fresh):
            v.fill_(3.0)
    ptr = arena.slot_flat(fresh).data_ptr()
    arena.free(fresh)
    again = arena.new_slot(microbatch=7)
    flat = arena.slot_flat(again)
    assert flat.data_ptr() == ptr and arena.pins(again) == {7: 1}
    assert torch.equal(flat[~mask], torch.full_like(flat[~mask], 3.0))  # no fill, no copy
    assert torch.count_nonzero(flat[mask]) == 0
    assert arena.bytes()["slots"] == arena.bytes()["live"] and arena.bytes()["pooled"] == 0
    # a snapshot's buffers, pooled and handed out by new_slot, have zero padding too
    assert arena.release(again, 7)
    s = arena.snapshot()
    arena.free(s)
    u = arena.new_slot()
    assert torch.equal(arena.slot_flat(u), arena.flat_param())
    assert torch.count_nonzero(arena.slot_flat(u)[mask]) == 0


# ----------------------------------------------------------------------------- swap_live


def test_swap_live_exchanges_memory_not_bytes() -> None:
    m = mlp()
    arena = flatten_(m)
    params = list(m.parameters())
    m(torch.randn(4, 7)).square().sum().backward()
    grads = [p.grad.clone() for p in params]
    grad_ptrs = [p.grad.data_ptr() for p in params]
    old_live = [p.detach().clone() for p in params]
    old_flat = arena.flat_param().data_ptr()
    old_ptrs = [p.data_ptr() for p in params]
    fv = flat_buffers_for(params)
    assert fv is not None
    before_view = m[0].weight.detach()[1]  # a view of the old live memory
    saved_row = before_view.clone()

    s = arena.new_slot(microbatch=0)
    arena.slot_flat(s).copy_(arena.flat_param() * 2)  # the caller fills the slot
    slot_flat = arena.slot_flat(s).data_ptr()
    bytes_before = arena.bytes()
    arena.swap_live(s)

    assert list(m.parameters()) == params and all(a is b for a, b in zip(m.parameters(), params, strict=True))
    assert arena.flat_param().data_ptr() == slot_flat  # live is the slot's old memory
    assert arena.slot_flat(s).data_ptr() == old_flat  # the slot is live's old memory
    assert [p.data_ptr() - slot_flat for p in params] == [q - old_flat for q in old_ptrs]
    for p, v, w in zip(params, old_live, arena.slot_views(s), strict=True):
        assert torch.equal(p.detach(), v * 2) and torch.equal(w, v)
    assert [p.grad.data_ptr() for p in params] == grad_ptrs  # gradients untouched
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert arena.pins(s) == {0: 1} and arena.bytes() == bytes_before
    assert flat_buffers_for(params) is fv and arena.flat_view(0) is fv
    assert fv.param.data_ptr() == slot_flat and fv.grads_are_views()
    assert torch.equal(before_view, saved_row)  # earlier views keep the old version
    assert torch.count_nonzero(arena.flat_param()[padding_mask(arena)]) == 0

    # writes to live after the swap (flat buffer, p.data) leave the slot alone
    fv.param.add_(1.0)
    with torch.no_grad():
        params[0].data.mul_(0.5)
    for w, v in zip(arena.slot_views(s), old_live, strict=True):
        assert torch.equal(w, v)
    assert torch.equal(before_view, saved_row)
    # swapping back returns to the original memory
    arena.swap_live(s)
    assert arena.flat_param().data_ptr() == old_flat and [p.data_ptr() for p in params] == old_ptrs
    assert torch.equal(m[0].weight.detach(), old_live[0])


def test_swap_live_keeps_an_in_flight_graph_on_its_version() -> None:
    """The use case: a forward ran on live; the slot takes that memory while the optimizer
    steps the new live copy; the backward still computes the forward's gradients."""
    m, ref = mlp(2), mlp(2)
    arena = flatten_(m)
    x, y = torch.randn(6, 7), torch.randn(6, 3)
    nn.functional.mse_loss(ref(x), y).backward()
    loss = nn.functional.mse_loss(m(x), y)  # nn.Linear saves weight.t(): a view
    s = arena.new_slot(microbatch=0)
    arena.slot_flat(s).copy_(arena.flat_param())
    arena.swap_live(s)
    fv = flat_buffers_for(arena.params)
    fv.param.add_(torch.randn_like(fv.param) * (~padding_mask(arena)))  # "optimizer step"
    arena.zero_grad()
    loss.backward()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=0), "backward saw the new weights"
    assert arena.release(s, 0)

    # a graph that saved the Parameter itself (conv) reads p.data: backward inside use()
    torch.manual_seed(0)
    conv, conv_ref = nn.Conv1d(2, 3, 3), nn.Conv1d(2, 3, 3)
    conv_ref.load_state_dict(conv.state_dict())
    carena = flatten_(conv)
    inp = torch.randn(2, 2, 9, requires_grad=True)
    inp_ref = inp.detach().clone().requires_grad_()
    conv_ref(inp_ref).square().sum().backward()
    out = conv(inp).square().sum()
    c = carena.new_slot(microbatch=0)
    carena.slot_flat(c).copy_(carena.flat_param())
    carena.swap_live(c)
    carena.flat_param().mul_(3.0)
    with carena.use(c):
        out.backward()
    assert torch.equal(inp.grad, inp_ref.grad)
    assert torch.equal(conv.weight.grad, conv_ref.weight.grad)


def test_swap_live_moves_every_bucket_and_the_lookup() -> None:
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(torch.randn(3, dtype=torch.float64))
    c = nn.Parameter(torch.randn(7), requires_grad=False)
    arena = flatten_([a, b, c])
    shadows = [nn.Parameter(v) for v in arena.live_views()]
    assert flat_buffers_for(shadows[:1]) is None  # found by identity only: no storage aliases
    old = [arena.flat_param(i).data_ptr() for i in range(3)]
    s = arena.snapshot()
    new = [arena.slot_flat(s, i).data_ptr() for i in range(3)]
    arena.swap_live(s)
    assert [arena.flat_param(i).data_ptr() for i in range(3)] == new
    assert [p.data_ptr() for p in (a, b, c)] == new
    assert [arena.slot_flat(s, i).data_ptr() for i in range(3)] == old
    for p in (a, b, c):
        fv = flat_buffers_for([p])
        assert fv is not None and fv.param.data_ptr() == p.data_ptr()
        assert arena.flat_view_for([p]) is fv
    with arena.use(s):
        assert flat_buffers_for([a]) is None  # pointing at a slot, not live


def test_swap_live_refuses_bad_slots_and_use() -> None:
    arena = flatten_(mlp(), name="st")
    s = arena.snapshot()
    with arena.use(s), pytest.raises(ArenaError, match="inside arena 'st'.*use"):
        arena.swap_live(s)
    arena.free(s)
    with pytest.raises(SlotError, match="already freed"):
        arena.swap_live(s)
    with pytest.raises(SlotError, match="no weight slot 42"):
        arena.swap_live(42)


# ----------------------------------------------------------------------------- double buffer


def test_double_buffer_is_live_plus_one_slot_and_swap_moves_no_bytes() -> None:
    m = mlp()
    arena = flatten_(m)
    per = arena.bytes()["live"]
    params = list(m.parameters())
    db = arena.rotation()
    assert arena.slots == [db.back] and arena.bytes()["slots"] == per  # one slot, not two
    assert torch.equal(arena.slot_flat(db.back), arena.flat_param())  # starts as a copy
    assert [v.data_ptr() for v in db.front_views()] == [p.data_ptr() for p in params]

    with torch.no_grad():
        m[0].weight.fill_(0.5)
    db.refresh_back()  # back = 0.5
    with torch.no_grad():
        m[0].weight.fill_(0.7)  # live = 0.7
    live_ptr, back_ptr = arena.flat_param().data_ptr(), arena.slot_flat(db.back).data_ptr()
    param_offsets = [p.data_ptr() - live_ptr for p in params]
    in_flight = m[0].weight.detach()  # what a forward's graph would have saved a view of
    db.swap()
    # the memories traded places: a byte copy would have left every pointer where it was
    assert arena.flat_param().data_ptr() == back_ptr
    assert arena.slot_flat(db.back).data_ptr() == live_ptr
    assert [p.data_ptr() - back_ptr for p in params] == param_offsets
    assert torch.equal(m[0].weight, torch.full_like(m[0].weight, 0.5))
    assert torch.equal(db.back_views()[0], torch.full_like(m[0].weight, 0.7))
    assert torch.equal(in_flight, torch.full_like(in_flight, 0.7))
    assert [v.data_ptr() for v in db.front_views()] == [p.data_ptr() for p in params]
    fv = flat_buffers_for(params)
    assert fv is not None and fv.param.data_ptr() == back_ptr
    assert arena.bytes()["slots"] == per and arena.bytes()["pooled"] == 0  # nothing allocated
    db.swap()
    assert arena.flat_param().data_ptr() == live_ptr
    assert torch.equal(m[0].weight, torch.full_like(m[0].weight, 0.7))


def test_double_buffer_holds_its_back_slot_until_closed() -> None:
    arena = flatten_(mlp())
    per = arena.bytes()["live"]
    db = arena.rotation()
    back = db.back
    with pytest.raises(RuntimeError, match="double buffer"):
        arena.free(back)
    arena.pin(back, 3)
    assert arena.refcount(back) == 2
    with pytest.raises(SlotError, match="pinned by micro-batch.*3"):
        db.refresh_back()  # micro-batch 3 still reads it
    db.swap()  # pins stay with the slot id
    assert arena.pins(back) == {3: 1}
    assert arena.release(back, 3) is False  # held: the last release does not free it
    assert back in arena.slots
    arena.pin(back, 4)
    db.close()  # pinned: the last release frees it
    assert back in arena.slots
    with pytest.raises(SlotError, match="closed"):
        db.swap()
    assert arena.release(back, 4) is True
    assert arena.slots == [] and arena.bytes()["slots"] == 0 and arena.bytes()["pooled"] == per
    db.close()  # twice is a no-op
    db2 = arena.rotation()
    db2.close()
    assert arena.slots == [] and arena.bytes()["pooled"] == per


# ----------------------------------------------------------------------------- flat_buffers_for


def test_flat_buffers_for_exact_bucket_only() -> None:
    m = mlp()
    arena = flatten_(m)
    params = list(m.parameters())
    fv = flat_buffers_for(params)
    assert isinstance(fv, FlatView)
    assert fv.param.data_ptr() == arena.flat_param().data_ptr()
    assert fv.grad is not None and fv.grad.data_ptr() == arena.flat_grad().data_ptr()
    assert fv.offsets == list(arena.buckets[0].offsets) and fv.numels == [91, 13, 39, 3]
    assert flat_buffers_for(tuple(params)) is fv
    assert flat_buffers_for(params[:2]) is None  # subset
    assert flat_buffers_for(params[::-1]) is None  # reordered
    assert flat_buffers_for([]) is None
    assert flat_buffers_for(list(mlp().parameters())) is None  # never flattened

    # optimizer state with the same layout
    state, views = fv.make_state()
    assert state.numel() == fv.param.numel() and state.data_ptr() % 256 == 0
    assert [v.shape for v in views] == [p.shape for p in params]
    state[fv.offsets[1]] = 9.0
    assert views[1][0].item() == 9.0

    # grads: None counts as zero, foreign tensors are copied in
    for p in params:
        p.grad = None
    m(torch.randn(2, 7)).sum().backward()
    assert not fv.grads_are_views()
    expected = [p.grad.clone() for p in params]
    params[3].grad = None
    fv.rebind_grads()
    assert fv.grads_are_views()
    for p, g in zip(params[:3], expected[:3], strict=False):
        assert torch.equal(p.grad, g)
    assert torch.count_nonzero(params[3].grad) == 0

    # the user replaces p.data: the bucket is no longer complete
    params[1].data = torch.zeros(13)
    assert flat_buffers_for(params) is None


# ----------------------------------------------------------------------------- bad input


def test_params_on_two_devices_are_rejected_by_name() -> None:
    m = mlp()
    m[2].to("meta")
    before = {n: p for n, p in m.named_parameters() if p.device.type == "cpu"}
    values = {n: p.detach().clone() for n, p in before.items()}
    with pytest.raises(ArenaError, match=r"'2\.weight' is on meta but '0\.weight' is on cpu"):
        flatten_(m, name="s1")
    for n, p in before.items():
        assert torch.equal(p.detach(), values[n])
    assert flat_buffers_for(list(m[0].parameters())) is None
    flatten_(m[0])  # the cpu part alone is still free to flatten


def test_integer_params_are_rejected_by_name() -> None:
    m = mlp()
    m.register_parameter("step", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    before, ptrs = clones(m), data_ptrs(m)
    with pytest.raises(ArenaError, match=r"'step' has integer/bool dtype torch\.int64.*register_buffer"):
        flatten_(m)
    assert_unchanged(m, before, ptrs)
    c = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ArenaError, match="complex"):
        flatten_([c])


def test_param_shared_by_two_stages_is_rejected_naming_both_arenas() -> None:
    shared = nn.Linear(4, 4)
    stage0 = nn.Sequential(shared, nn.ReLU())
    stage1 = nn.Sequential(nn.Linear(4, 4), shared)
    a0 = flatten_(stage0, name="stage0")
    before, ptrs = clones(stage1), data_ptrs(stage1)
    with pytest.raises(ArenaError, match=r"'1\.weight' already belongs to arena 'stage0'.*'stage1'"):
        flatten_(stage1, name="stage1")
    assert_unchanged(stage1, before, ptrs)  # stage1's own Linear did not move either
    assert flat_buffers_for(list(stage1[0].parameters())) is None
    assert flat_buffers_for(a0.params) is not None  # and stage0 still owns its weights


def test_duplicate_and_non_leaf_inputs_are_rejected() -> None:
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ArenaError, match="same tensor"):
        flatten_([p, p])
    with pytest.raises(ArenaError, match="not a leaf"):
        flatten_([p * 2])
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        flatten_([p, 3.0])  # type: ignore[list-item]
    assert flat_buffers_for([p]) is None


def test_arena_can_be_deep_copied_module_wise() -> None:
    # a deep copy of a flattened module is independent (other stages may clone it)
    m = mlp()
    flatten_(m, name="orig")
    twin = copy.deepcopy(m)
    other = flatten_(twin, name="twin")
    assert isinstance(other, WeightArena)
    with torch.no_grad():
        twin[0].bias.add_(1)
    assert not torch.equal(twin[0].bias, m[0].bias)


# ----------------------------------------------------------------------------- L2 / CUDA


def test_l2_persistence_on_cpu_reports_unsupported() -> None:
    arena = flatten_(mlp())
    r = arena.set_l2_persistence()
    assert r.supported is False and r.ok is False and r.granted_bytes == 0
    assert "CUDA" in r.reason
    with pytest.raises(ArenaError, match="hit_ratio"):
        arena.set_l2_persistence(hit_ratio=1.5)
    with pytest.raises(ArenaError, match="no L2 window"):
        arena.clear_l2_persistence()


def test_cpu_slot_api_is_unchanged_and_there_is_no_snapshot_stream() -> None:
    import inspect

    def shape(fn) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    kw = inspect.Parameter.KEYWORD_ONLY
    pos = inspect.Parameter.POSITIONAL_OR_KEYWORD
    empty = inspect.Parameter.empty
    assert shape(WeightArena.release) == [
        ("self", pos, empty), ("slot", pos, empty), ("microbatch", pos, empty), ("stream", kw, None)
    ]
    assert shape(WeightArena.free) == [("self", pos, empty), ("slot", pos, empty), ("stream", kw, None)]
    assert shape(WeightArena.snapshot) == [
        ("self", pos, empty), ("microbatch", pos, None), ("stream", kw, None), ("overlap", kw, False)
    ]
    assert shape(WeightArena.new_slot) == [("self", pos, empty), ("microbatch", pos, None), ("stream", kw, None)]
    arena = flatten_(mlp())
    s = arena.snapshot(microbatch=0)
    ptr = arena.slot_flat(s).data_ptr()
    assert arena.snapshot_stream() is None  # CPU copies are synchronous: no stream
    assert arena.release(s, 0) is True
    assert arena.slot_flat(arena.new_slot()).data_ptr() == ptr  # the released set, reused
    r = arena.set_l2_window(share_bytes=1 << 20)
    assert r.supported is False and r.ok is False and r.granted_bytes == 0 and "CUDA" in r.reason
    with pytest.raises(ArenaError, match="share_bytes"):
        arena.set_l2_window(share_bytes=-1)
    with pytest.raises(ArenaError, match="no L2 window"):
        arena.clear_l2_window()


def ordered_streams(n: int) -> list[torch.cuda.Stream]:
    """``n`` new CUDA streams, each ordered after the work queued so far on the current one.

    Why every CUDA test here takes its side streams from this: ``flatten_`` writes the live
    buffers (a zero fill, then a copy of the module's weights) on the *current* stream, the
    legacy default stream in these tests, and ``torch.cuda.Stream()`` is created with
    ``cudaStreamNonBlocking``, so nothing orders a new stream after it. Work on the new stream
    (``m.weight.fill_(2.0)``, a clone, the snapshot copy, which waits only for the stream it
    is given) could then run before or interleaved with flatten_'s fill and copy; with 12
    pytest workers time-slicing one H100 the queued work of both streams is dispatched
    together, and test_cuda_release_... once saw the fill undone by flatten_'s copy (the slot
    held the initial weights) and its ``expected`` clone taken between the zero fill and the
    copy (all zeros). Same rule as any torch tensor made on one stream and used on another.
    """
    current = torch.cuda.current_stream()
    out = []
    for _ in range(n):
        s = torch.cuda.Stream()
        s.wait_stream(current)
        out.append(s)
    return out


@pytest.mark.cuda
def test_cuda_async_snapshot_waits_on_its_event() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda()
    arena = flatten_(m)
    assert all(p.data_ptr() % 256 == 0 for p in m.parameters())
    (side,) = ordered_streams(1)
    with torch.cuda.stream(side):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(3.0)  # queued work the snapshot must wait for
        expected = [p.detach().clone() for p in m.parameters()]
        s = arena.snapshot(microbatch=0, overlap=True)
        fv = flat_buffers_for(arena.params)  # waits for the copy before we write live
        assert fv is not None
        fv.param.add_(1.0)
        views = arena.slot_views(s)
        got = [v.clone() for v in views]
        # default (overlap=False): a plain per-tensor update right after is safe too
        s2 = arena.snapshot()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        got2 = [v.clone() for v in arena.slot_views(s2)]
    torch.cuda.synchronize()
    for g, e in zip(got, expected, strict=False):
        assert torch.equal(g, e)
    for g, e in zip(got2, expected, strict=False):
        assert torch.equal(g, e + 1.0)
    arena.free(s2)
    x = torch.randn(8, 1024, device="cuda")
    with arena.use(s):
        y_slot = m(x)
    y_slot.sum().backward()
    assert arena.flat_grad().abs().sum().item() > 0
    assert arena.release(s, 0) and arena.bytes()["slots"] == 0
    # a double buffer swapped right after an overlapped refresh: the stream waits for it
    db = arena.rotation()
    with torch.no_grad():
        m[0].weight.add_(1.0)
    expected = m[0].weight.detach().clone()
    in_flight = m[0].weight.detach()
    back_ptr = arena.slot_flat(db.back).data_ptr()
    db.refresh_back(overlap=True)
    db.swap()
    arena.flat_param().mul_(0.0)  # an "optimizer step" on the new live memory
    assert m[0].weight.data_ptr() - arena.flat_param().data_ptr() == 0
    assert arena.flat_param().data_ptr() == back_ptr
    torch.cuda.synchronize()
    assert torch.equal(db.back_views()[0], expected) and torch.equal(in_flight, expected)
    assert torch.count_nonzero(m[0].weight) == 0
    db.close()


@pytest.mark.cuda
def test_cuda_swap_live_waits_for_the_pending_copy_and_pool_reuse_is_ordered() -> None:
    torch.manual_seed(0)
    m = nn.Linear(2048, 2048).cuda()
    arena = flatten_(m)
    (side,) = ordered_streams(1)
    with torch.cuda.stream(side):
        with torch.no_grad():
            m.weight.mul_(2.0)  # queued work the snapshot must see
        expected = m.weight.detach().clone()
        x = arena.snapshot(microbatch=0, overlap=True)  # the copy may still be running
        old_live = arena.flat_param().data_ptr()
        arena.swap_live(x, stream=side)  # side waits for the copy: live = its destination
        live_after = m.weight.detach().clone()
        arena.flat_param().add_(1.0)  # the optimizer writes the new live memory
        slot_after = arena.slot_views(x)[0].clone()
        assert arena.release(x, 0, stream=side)  # pooled, release event on side
        y = arena.new_slot(stream=side)
        assert arena.slot_flat(y).data_ptr() == old_live
        arena.slot_flat(y).copy_(arena.flat_param())
        got_y = arena.slot_views(y)[0].clone()
    torch.cuda.synchronize()
    assert torch.equal(live_after, expected)
    assert torch.equal(slot_after, expected)
    assert torch.equal(got_y, expected + 1.0)
    arena.free(y)
    assert arena.trim_pool() == arena.bytes()["live"] and arena.bytes()["pooled"] == 0


@pytest.mark.cuda
def test_cuda_l2_persistence_reports_granted_bytes() -> None:
    m = nn.Linear(512, 512).cuda()
    arena = flatten_(m)
    (stream,) = ordered_streams(1)  # its backward accumulates into flatten_'s zeroed grads
    with torch.cuda.stream(stream):
        r = arena.set_l2_persistence(stream=stream)
        try:
            assert r.supported
            major, _ = torch.cuda.get_device_capability()
            if major >= 8:
                assert r.ok, r.reason
                assert 0 < r.granted_bytes <= r.max_persisting_bytes
                assert 0 < r.window_bytes <= arena.buckets[0].nbytes
                assert 0.0 < r.hit_ratio <= 1.0
            m(torch.randn(4, 512, device="cuda")).sum().backward()
        finally:
            arena.clear_l2_persistence(stream=stream)
    torch.cuda.synchronize()


# torch.cuda._sleep cycles: about a second at GPU clocks, far longer than any host call here
_LONG = 2_000_000_000


@pytest.mark.cuda
def test_cuda_each_arena_copies_on_its_own_snapshot_stream() -> None:
    a = flatten_(nn.Linear(256, 256).cuda(), name="a")
    b = flatten_(nn.Linear(256, 256).cuda(), name="b")
    assert a.snapshot_stream() is None and b.snapshot_stream() is None  # created lazily
    busy, idle = ordered_streams(2)  # b's copy must see flatten_'s copy into b's live
    with torch.cuda.stream(busy):
        torch.cuda._sleep(_LONG)
        sa = a.snapshot(overlap=True)  # a's copy waits for the sleep, on a's stream
    sb = b.snapshot(stream=idle)  # idle waits (on the device) for b's copy
    idle.synchronize()
    assert not busy.query(), "b's copy queued behind a's: the arenas share a stream"
    ha, hb = a.snapshot_stream(), b.snapshot_stream()
    assert ha and hb and ha != hb
    assert not {ha, hb} & {busy.cuda_stream, idle.cuda_stream, torch.cuda.current_stream().cuda_stream}
    torch.cuda.synchronize()
    assert torch.equal(a.slot_flat(sa), a.flat_param()) and torch.equal(b.slot_flat(sb), b.flat_param())
    a.free(sa)
    b.free(sb)
    del a, b  # their streams are destroyed with them
    gc_arena = flatten_(nn.Linear(8, 8).cuda())
    gc_arena.free(gc_arena.snapshot())
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_release_does_not_block_the_host_and_the_next_user_waits_on_the_device() -> None:
    import time

    m = nn.Linear(1024, 1024).cuda()
    # flatten_'s fill and copy into live queue behind a sleep on the current stream: a test
    # stream not ordered after it would certainly run fill_(2.0) first and see it undone
    torch.cuda._sleep(_LONG // 2)
    arena = flatten_(m)
    stream, other = ordered_streams(2)
    with torch.cuda.stream(stream):
        with torch.no_grad():
            m.weight.fill_(2.0)
        expected = m.weight.detach().clone()
        torch.cuda._sleep(_LONG)
        s = arena.snapshot(microbatch=0, overlap=True)  # its copy waits for the sleep
        t0 = time.perf_counter()
        assert arena.release(s, 0, stream=stream)
        took = time.perf_counter() - t0
        assert not stream.query(), "release waited on the host for the pending copy"
        assert took < 0.1, took
        t0 = time.perf_counter()
        y = arena.new_slot(stream=stream)  # the pooled set; its copy is still pending
        assert time.perf_counter() - t0 < 0.1 and not stream.query()
        got = arena.slot_views(y)[0].clone()  # ordered after the copy, on the device
    # a writer of live on another stream waits for the copy still reading live
    with torch.cuda.stream(other):
        fv = flat_buffers_for(arena.params)
        assert fv is not None
        fv.param.mul_(0.0)
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
    assert torch.equal(arena.slot_views(y)[0], expected)
    assert torch.count_nonzero(m.weight) == 0
    arena.free(y)
    # released while its copy ran, handed out after: the copy's values, nothing torn
    with torch.cuda.stream(stream):
        with torch.no_grad():
            m.weight.fill_(3.0)
        torch.cuda._sleep(_LONG)
        s = arena.snapshot(microbatch=1, overlap=True)
        assert arena.release(s, 1, stream=stream) and not stream.query()
    with torch.cuda.stream(other):
        z = arena.new_slot(stream=other)  # other waits for the copy and the release
        got = arena.slot_views(z)[0].clone()
    torch.cuda.synchronize()
    assert torch.equal(got, torch.full_like(got, 3.0))
    arena.free(z)
    assert arena.trim_pool() == arena.bytes()["live"]


@pytest.mark.cuda
def test_cuda_a_writer_of_live_waits_for_a_released_slots_pending_copy() -> None:
    """The pooled set keeps its pending copy's event (wait_all covers the pool); CPU twin:
    test_arena_twin.py::test_twin_pooled_set_goes_to_another_stream_after_its_readers."""
    m = nn.Linear(1024, 1024).cuda()
    arena = flatten_(m)
    stream, other = ordered_streams(2)
    with torch.cuda.stream(stream):
        with torch.no_grad():
            m.weight.fill_(2.0)
        torch.cuda._sleep(_LONG)
        s = arena.snapshot(microbatch=0, overlap=True)  # its copy waits for the sleep
        assert arena.release(s, 0, stream=stream)  # pooled, the copy still pending
    with torch.cuda.stream(other):
        fv = flat_buffers_for(arena.params)  # other waits for the pooled set's copy
        assert fv is not None
        with torch.no_grad():  # (through the weight: the padding stays zero)
            m.weight.fill_(5.0)  # without that wait this runs first and the copy reads 5.0
        y = arena.new_slot(stream=other)  # the same set, after its copy and release
        got = arena.slot_views(y)[0].clone()
    assert not stream.query(), "the host waited for the copy"
    torch.cuda.synchronize()
    assert torch.equal(got, torch.full_like(got, 2.0))
    assert torch.equal(m.weight.detach(), torch.full_like(got, 5.0))
    arena.free(y)
    assert arena.trim_pool() == arena.bytes()["live"]


@pytest.mark.cuda
def test_cuda_two_arenas_share_the_set_aside_through_windows() -> None:
    from engine.arena import l2

    dev = torch.cuda.current_device()
    limits = l2.device_limits(dev)
    if not limits["supported"] or limits["reason"]:
        pytest.skip(f"no persisting L2 here: {limits['reason']}")
    a, b = flatten_(nn.Linear(512, 512).cuda()), flatten_(nn.Linear(256, 256).cuda())
    sa, sb = ordered_streams(2)
    share = min(limits["max_persisting_bytes"] // 4, a.buckets[0].nbytes // 2)
    got = l2.set_aside(dev, 2 * share)
    try:
        assert got["ok"], got["reason"]
        ra = a.set_l2_window(share_bytes=share, stream=sa)
        rb = b.set_l2_window(share_bytes=share, stream=sb)
        assert ra.ok and rb.ok, (ra.reason, rb.reason)
        assert ra.granted_bytes == share and ra.hit_ratio == pytest.approx(share / ra.window_bytes, rel=1e-5)
        a.clear_l2_window(stream=sa)  # only a's window: b's and the set-aside stay
        assert l2.stream_window(dev, sa.cuda_stream)["num_bytes"] == 0
        assert l2.stream_window(dev, sb.cuda_stream)["base"] == b.flat_param().data_ptr()
        assert l2.device_limits(dev)["set_aside_bytes"] == got["granted_bytes"] > 0
    finally:
        b.clear_l2_window(stream=sb)
        l2.reset(dev)
    assert l2.device_limits(dev)["set_aside_bytes"] == 0


def test_arena_lives_with_its_params_and_is_collected_with_them() -> None:
    import gc
    import pickle
    import weakref

    m = mlp()
    ref = weakref.ref(flatten_(m))  # the return value is dropped on purpose
    gc.collect()
    assert ref() is not None
    assert flat_buffers_for(list(m.parameters())) is not None
    # a pickled copy is not in the arena
    twin = pickle.loads(pickle.dumps(m))
    assert flat_buffers_for(list(twin.parameters())) is None
    flatten_(twin)
    del m
    gc.collect()
    assert ref() is None


# ----------------------------------------------------------------------------- bench/l2_persistence.py

BENCH = __import__("pathlib").Path(__file__).resolve().parents[2] / "bench" / "l2_persistence.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_l2_bench_exits_cleanly_without_gpu(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no GPU" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing pretends to be a measurement


@pytest.mark.cuda
def test_l2_bench_writes_ratio_and_granted_bytes(tmp_path) -> None:
    import csv
    import runpy

    bench = runpy.run_path(str(BENCH))
    assert bench["main"](["--out", str(tmp_path), "--iters", "10", "--warmup", "2", "--layers", "2"]) == 0
    (row,) = list(csv.DictReader((tmp_path / "l2_persistence.csv").open()))
    assert row["device"] == torch.cuda.get_device_name()
    assert int(row["granted_bytes"]) >= 0 and row["speedup"]
    if torch.cuda.get_device_capability()[0] >= 8:
        assert int(row["granted_bytes"]) > 0 and float(row["speedup"]) > 0


def test_random_layouts_are_aligned_disjoint_and_exact() -> None:
    """Property check over random shapes (zero-size included), dtypes and alignments."""
    gen = torch.Generator().manual_seed(1234)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    for case in range(25):
        alignment = 2 ** int(torch.randint(0, 11, (1,), generator=gen))  # 1 .. 1024 bytes
        dtype = dtypes[case % len(dtypes)]
        shapes = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
            rank = int(torch.randint(0, 3, (1,), generator=gen))
            shapes.append(tuple(int(d) for d in torch.randint(0, 6, (rank,), generator=gen)))
        params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        values = [p.detach().clone() for p in params]
        arena = flatten_(params, alignment=alignment)
        (bucket,) = arena.buckets
        item = params[0].element_size()
        spans = []
        for p, v, off, n in zip(params, values, bucket.offsets, bucket.numels, strict=True):
            assert torch.equal(p.detach(), v) and p.shape == v.shape
            assert (off * item) % alignment == 0 and p.data_ptr() % max(alignment, item) == 0
            spans.append((off, off + n))
        for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False):
            assert a1 <= b0  # in order, never overlapping
        assert spans[-1][1] <= bucket.numel and (bucket.numel * item) % alignment == 0
        flat = arena.flat_param()
        mask = torch.ones(bucket.numel, dtype=torch.bool)
        for a, b in spans:
            mask[a:b] = False
        assert torch.count_nonzero(flat[mask]) == 0
