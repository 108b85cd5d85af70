"""CPU twins of the arena's CUDA ordering (engine/testing/arena_twin.py).

Why: the arena's stream/event logic (csrc/arena.cpp) is CUDA code written without a GPU at
hand, and a race in it, or in a test of it, shows only now and then on one (H100, 12 pytest
workers: test_cuda_release_... passed, then failed with the same code). A traced CPU arena
runs that same logic and logs its CUDA calls; ArenaTwin replays them on a happens-before
model of the device next to what each CUDA test does on its streams. Each CUDA test of
tests/arena/test_arena.py that orders streams has its twin here, run with events that are still
pending (every wait enqueued) and already done (waits skipped), and the twin of the old form
of the release test shows the race it had.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.arena import flat_buffers_for, flatten_
from engine.testing.arena_twin import ArenaTwin

DONE = pytest.mark.parametrize("events_done", [False, True], ids=["pending", "done"])


def twinned(module: nn.Module, events_done: bool) -> tuple:
    arena = flatten_(module)
    twin = ArenaTwin(arena, events_done=events_done)
    # flatten_ filled and copied live on the current stream
    twin.write(arena.flat_param(), "flatten_'s fill and copy into live")
    return arena, twin


def release_test(twin: ArenaTwin, arena, ordered: bool) -> None:
    """test_cuda_release_does_not_block_the_host_and_the_next_user_waits_on_the_device, step
    by step: its streams' work as declared accesses, the arena calls as they are."""
    stream, other = twin.stream("stream"), twin.stream("other")
    if ordered:  # ordered_streams(2)
        twin.wait_stream(stream, twin.default)
        twin.wait_stream(other, twin.default)
    live = arena.flat_param()
    with twin.use(stream):
        twin.write(live, "m.weight.fill_(2.0)")
        twin.read(live, "expected = m.weight.clone()")
        s = arena.snapshot(microbatch=0, overlap=True)
        assert arena.release(s, 0, stream=stream)
        y = arena.new_slot(stream=stream)
        twin.read(arena.slot_views(y)[0], "got = slot_views(y)[0].clone()")
    with twin.use(other):
        fv = flat_buffers_for(arena.params)
        assert fv is not None
        twin.write(fv.param, "fv.param.mul_(0.0)")
    twin.synchronize()
    arena.free(y)  # on the default stream, after the synchronize
    with twin.use(stream):
        twin.write(live, "m.weight.fill_(3.0)")
        s = arena.snapshot(microbatch=1, overlap=True)
        assert arena.release(s, 1, stream=stream)
    with twin.use(other):
        z = arena.new_slot(stream=other)
        twin.read(arena.slot_views(z)[0], "got = slot_views(z)[0].clone()")
    twin.synchronize()
    arena.free(z)
    assert arena.trim_pool() == arena.bytes()["live"]


@DONE
def test_twin_of_the_release_test_is_ordered(events_done: bool) -> None:
    arena, twin = twinned(nn.Linear(64, 64), events_done)
    release_test(twin, arena, ordered=True)
    assert twin.races == [] and twin.misuse == []
    assert twin.live_events() == set()  # trim_pool synced and destroyed every event


@DONE
def test_twin_shows_the_race_of_the_old_release_test(events_done: bool) -> None:
    """The old test used fresh torch.cuda.Stream()s (non-blocking: not ordered after the
    default stream) right after flatten_: its fill_(2.0), its expected clone and the
    snapshot copy raced flatten_'s own writes to live, the failure seen on the H100."""
    arena, twin = twinned(nn.Linear(64, 64), events_done)
    release_test(twin, arena, ordered=False)
    flatten_writes = "flatten_'s fill and copy into live on default"
    assert f"m.weight.fill_(2.0) on stream is not ordered after {flatten_writes}" in twin.races
    assert f"expected = m.weight.clone() on stream is not ordered after {flatten_writes}" in twin.races
    assert any(r.startswith("the snapshot copy") and r.endswith(flatten_writes) for r in twin.races)
    assert all(r.endswith(flatten_writes) for r in twin.races), twin.races  # nothing else
    assert twin.misuse == []


def test_twin_catches_a_writer_of_live_that_does_not_wait() -> None:
    """The model is not blind: writing live on another stream past a pending copy, or
    reading a slot without slot_views's wait, is reported."""
    arena, twin = twinned(nn.Linear(16, 16), events_done=False)
    stream, other = twin.stream("stream"), twin.stream("other")
    twin.wait_stream(stream, twin.default)
    twin.wait_stream(other, twin.default)
    with twin.use(stream):
        s = arena.snapshot(overlap=True)
    twin.write(arena.flat_param(), "an optimizer step without flat_buffers_for", stream=other)
    twin.read(arena._core.slot_flat(s, 0), "a read of the slot without its wait", stream=other)
    assert twin.races == [
        "an optimizer step without flat_buffers_for on other is not ordered after the snapshot "
        "copy (event 1) reading live on the snapshot stream",
        "a read of the slot without its wait on other is not ordered after the snapshot copy "
        "(event 1) writing its slot on the snapshot stream",
    ]


@DONE
def test_twin_of_the_async_snapshot_test(events_done: bool) -> None:
    torch.manual_seed(0)
    arena, twin = twinned(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), events_done)
    side = twin.stream("side")
    twin.wait_stream(side, twin.default)
    live = arena.flat_param()
    with twin.use(side):
        twin.write(live, "p.mul_(3.0)")
        twin.read(live, "expected clones")
        s = arena.snapshot(microbatch=0, overlap=True)
        fv = flat_buffers_for(arena.params)
        twin.write(fv.param, "fv.param.add_(1.0)")
        twin.read(arena.slot_flat(s), "got clones")
        s2 = arena.snapshot()  # overlap=False: the stream waits at once
        twin.write(live, "p.add_(1.0) per tensor")
        twin.read(arena.slot_flat(s2), "got2 clones")
    twin.synchronize()
    arena.free(s2)
    twin.read(arena.slot_flat(s), "use(s): the forward on the default stream")
    assert arena.release(s, 0)
    db = arena.rotation()
    twin.write(live, "m[0].weight.add_(1.0)")
    db.refresh_back(overlap=True)
    db.swap()
    twin.write(arena.flat_param(), "arena.flat_param().mul_(0.0) on the new live memory")
    twin.synchronize()
    twin.read(arena.slot_flat(db.back), "back_views()")
    db.close()
    arena.trim_pool()
    assert twin.races == [] and twin.misuse == []


@DONE
def test_twin_of_the_swap_live_test(events_done: bool) -> None:
    arena, twin = twinned(nn.Linear(64, 64), events_done)
    side = twin.stream("side")
    twin.wait_stream(side, twin.default)
    with twin.use(side):
        twin.write(arena.flat_param(), "m.weight.mul_(2.0)")
        x = arena.snapshot(microbatch=0, overlap=True)
        arena.swap_live(x, stream=side)
        twin.read(arena.flat_param(), "live_after clone")
        twin.write(arena.flat_param(), "flat_param().add_(1.0)")
        twin.read(arena.slot_flat(x), "slot_after clone")
        assert arena.release(x, 0, stream=side)
        y = arena.new_slot(stream=side)
        twin.write(arena.slot_flat(y), "slot_flat(y).copy_(flat_param())")
        twin.read(arena.slot_flat(y), "got_y clone")
    twin.synchronize()
    arena.free(y)
    arena.trim_pool()
    assert twin.races == [] and twin.misuse == []


@DONE
def test_twin_pooled_set_goes_to_another_stream_after_its_readers(events_done: bool) -> None:
    """A slot read on one stream, released there with its copy still pending, then handed
    to a writer on another stream (new_slot) or to a new snapshot there: both wait."""
    arena, twin = twinned(nn.Linear(32, 32), events_done)
    a, b = twin.stream("a"), twin.stream("b")
    twin.wait_stream(a, twin.default)
    twin.wait_stream(b, twin.default)
    with twin.use(a):
        s = arena.snapshot(microbatch=0, overlap=True)
        twin.read(arena.slot_flat(s), "a backward reading the stashed weights")
        assert arena.release(s, 0, stream=a)
    with twin.use(b):  # the pooled set's copy still reads live: a writer waits for it
        fv = flat_buffers_for(arena.params)
        assert fv is not None
        twin.write(fv.param, "an optimizer step while the released slot's copy is pending")
        y = arena.new_slot(stream=b)
        # written as new_slot's contract says (on b), without another wait
        twin.write(arena._core.slot_flat(y, 0), "a predicted version written into the new slot")
        arena.free(y, stream=b)
        z = arena.snapshot(stream=b, overlap=True)  # the same set again, copy pending
    with twin.use(a):
        arena.wait_for_snapshots(stream=a)
        twin.write(arena.flat_param(), "an optimizer step after wait_for_snapshots")
        arena.restore(z, stream=a)
        twin.read(arena._core.slot_flat(z, 0), "restore reading slot z")
        twin.write(arena.flat_param(), "restore's copy into live")
    twin.synchronize()
    arena.free(z)
    assert twin.races == [] and twin.misuse == []


@DONE
def test_twin_trim_pool_frees_nothing_still_in_use(events_done: bool) -> None:
    arena, twin = twinned(nn.Linear(32, 32), events_done)
    s = twin.stream("s")
    twin.wait_stream(s, twin.default)
    with twin.use(s):
        slot = arena.snapshot(microbatch=0, overlap=True)
        buf = arena._core.slot_flat(slot, 0)
        twin.read(arena.slot_flat(slot), "a forward on the stashed weights")
        assert arena.release(slot, 0, stream=s)
    assert arena.trim_pool() > 0
    twin.host_free(buf, "the trimmed slot buffer")
    assert twin.races == [] and twin.misuse == []
    assert twin.live_events() == set()


@pytest.mark.parametrize("seed", range(12))
def test_twin_random_programs_that_keep_the_contract_never_race(seed: int) -> None:
    """Random interleavings of every slot operation over three streams, written the way the
    docstrings ask (read a slot through slot_views on the stream that releases it, write live
    through flat_buffers_for, write a new_slot on the stream it was handed to)."""
    rng = random.Random(seed)
    arena, twin = twinned(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), events_done=seed % 2 == 1)
    streams = [twin.stream(f"s{i}") for i in range(3)]
    for st in streams:
        twin.wait_stream(st, twin.default)
    slots: dict[int, object] = {}  # slot -> the stream that last read or wrote it
    live_user = twin.default  # the stream that last touched live

    def after(st, prev) -> None:  # hand-over between streams, as the caller must order it
        if prev is not st:
            twin.wait_stream(st, prev)

    for step in range(80):
        st = rng.choice(streams)
        op = rng.choice(["snapshot", "new_slot", "read", "release", "write_live", "swap",
                         "restore", "trim"])
        with twin.use(st):
            if op == "snapshot" or (op in ("read", "release", "swap", "restore") and not slots):
                after(st, live_user)
                live_user = st
                s = arena.snapshot(microbatch=step, overlap=rng.random() < 0.7)
                slots[s] = st
            elif op == "new_slot":
                s = arena.new_slot(microbatch=step)
                twin.write(arena._core.slot_flat(s, 0), f"step {step}: writing new slot {s}")
                slots[s] = st
            elif op == "read":
                s = rng.choice(sorted(slots))
                after(st, slots[s])
                twin.read(arena.slot_flat(s), f"step {step}: reading slot {s}")
                slots[s] = st
            elif op == "release":
                s = rng.choice(sorted(slots))
                after(st, slots[s])
                (mb,) = arena.pins(s)
                assert arena.release(s, mb)
                del slots[s]
            elif op == "write_live":
                after(st, live_user)
                live_user = st
                fv = flat_buffers_for(arena.params)
                assert fv is not None
                twin.write(fv.param, f"step {step}: an optimizer step")
            elif op == "swap":
                s = rng.choice(sorted(slots))
                after(st, slots[s])
                after(st, live_user)
                arena.swap_live(s)
                live_user = slots[s] = st
                twin.write(arena.flat_param(), f"step {step}: an optimizer step on the swapped-in live")
            elif op == "restore":
                s = rng.choice(sorted(slots))
                after(st, slots[s])
                after(st, live_user)
                arena.restore(s)
                twin.read(arena._core.slot_flat(s, 0), f"step {step}: restore reading slot {s}")
                twin.write(arena.flat_param(), f"step {step}: restore writing live")
                live_user = slots[s] = st
            elif op == "trim":
                arena.trim_pool()
    assert twin.races == [] and twin.misuse == [], (twin.races[:5], twin.misuse[:5])


def test_cuda_arena_tests_order_their_streams() -> None:
    """The precondition the old release test missed, held for every CUDA test of the arena:
    no bare torch.cuda.Stream() (non-blocking, unordered with flatten_'s writes); streams
    come from ordered_streams()."""
    tree = ast.parse((Path(__file__).parent / "test_arena.py").read_text())
    bare = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name == "ordered_streams":
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.cuda.Stream":
                bare.append(f"{fn.name} (line {node.lineno})")
    assert not bare, f"use ordered_streams() instead of torch.cuda.Stream() in: {bare}"
