"""Hand-over memory with per-stage streams, without ``record_stream`` (issue 23, item 3).

A tensor made on one stage's stream and read on another's used to be handed to the caching
allocator with ``record_stream``: an allocator event recorded at its free and polled with
``cudaEventQuery`` before its block is reused (120 queries per pb step on an H100). Now
StageStreams holds each handed-over storage and releases it right after the next
``wait_caller`` once it was alone at a join (engine/runtime/exec/streams.py). The recording
backend (engine.testing.stream_recorder) follows every handed-over storage until it is
freed, with a vector clock per stream, and reports a free that could let its block be
reused before a reader is done. These tests hold the executor to: no ``record_stream`` in
steady state, no unsafe free, every storage kept past the next ``wait_caller``, nothing
alone kept past a step's start, results bitwise equal to the stream-less pipeline -- and a
reference dropped early on purpose is found.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.optim
from engine.runtime.exec.streams import StageStreams
from engine.testing.stream_recorder import recording_streams

S, M, D = 4, 4, 5
_use_count = torch._C._storage_Use_Count


def make(schedule: str, **kw) -> engine.Pipeline:
    kw.setdefault("checkpoint", "never")
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    mods.append(nn.Linear(D, 2))
    return engine.Pipeline(
        mods, schedule=schedule, chunks=M, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9), **kw,
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(M, D, generator=g), torch.randn(M, 2, generator=g)) for _ in range(n)]


def pipe_streams(pipe: engine.Pipeline) -> list:
    return list(pipe.parts.executor.streams.streams.values())


def _watch_step_starts(pipe: engine.Pipeline) -> list[int]:
    """After each wait_caller: nothing the streams hold is alone (held at most until then)."""
    streams = pipe.parts.executor.streams
    inner = streams.wait_caller
    lonely: list[int] = []

    def wait_caller() -> None:
        inner()
        kept = (*streams.memory_held.values(), *streams.memory_to_caller.values())
        lonely.append(sum(_use_count(st._cdata) == 1 for st in kept))
        assert streams.memory_ready == []

    streams.wait_caller = wait_caller  # type: ignore[method-assign]
    return lonely


CASES = [
    ("pb", {}), ("pb", {"on_nonfinite": "skip_update"}), ("1f1b", {}), ("gpipe", {}),
    ("pipedream", {}), ("zbh1", {}), ("1f1b", {"clip_grad_norm": 1.0}),
]


@pytest.mark.parametrize(("schedule", "kw"), CASES,
                         ids=["pb", "pb-skip_update", "1f1b", "gpipe", "pipedream", "zbh1", "1f1b-clip"])
def test_hand_overs_are_held_not_recorded(schedule: str, kw: dict) -> None:
    pipe, plain = make(schedule, **kw), make(schedule, **kw)
    backend = recording_streams(pipe)
    lonely = _watch_step_starts(pipe)
    data = batches(6)
    for x, y in data:
        assert torch.equal(pipe.step(x, y), plain.step(x, y))
    a, b = pipe.flush(), plain.flush()
    assert (a is None and b is None) or torch.equal(a, b)
    pipe.step(*data[0])
    plain.step(*data[0])
    for sa, sb in zip(pipe.stages, plain.stages, strict=True):
        for fa, fb in zip(sa.store.live_flats(), sb.store.live_flats(), strict=True):
            assert torch.equal(fa, fb)
    assert backend.counts["record_stream"] == 0 and backend.counts["event_query"] == 0
    assert backend.violations == [] and backend.early_frees == []
    assert lonely and all(n == 0 for n in lonely), lonely  # released at every step's start
    freed = backend.lifetimes
    assert len(freed) >= 6 * M  # (inputs and targets at least: the check is not vacuous)
    # every handed-over storage outlived the next wait_caller (a caller event after it)
    assert all(end > start for start, end in freed), [x for x in freed if x[1] <= x[0]][:5]


def test_held_memory_is_bounded() -> None:
    """What is held never grows with the number of steps: one step's hand-overs at most.
    (The batches are dropped after their step: a storage the user still references stays
    in the bookkeeping, at no cost in memory, until it is alone.)"""
    pipe = make("pb")
    recording_streams(pipe)
    streams = pipe.parts.executor.streams
    sizes = []
    g = torch.Generator().manual_seed(2)
    for _ in range(12):
        pipe.step(torch.randn(M, D, generator=g), torch.randn(M, 2, generator=g))
        sizes.append(len(streams.memory_held) + len(streams.memory_ready) + len(streams.memory_to_caller))
    assert max(sizes[4:]) == max(sizes[4:8]) and max(sizes) <= 4 * S * M, sizes


@pytest.mark.parametrize("schedule", ["pb", "1f1b"])
def test_a_reference_dropped_early_is_found(schedule: str, monkeypatch) -> None:
    """Streams that forget to hold (watched, then let go at once) free activations while
    the stage that read them is not joined to the caller: the recorder sees it."""
    inner = StageStreams._hold

    def forgetful(self, t, producer, readers, *rest) -> None:
        inner(self, t, producer, readers, *rest)
        self.memory_held.clear()  # the reference dropped early, on purpose
        self.memory_to_caller.clear()

    monkeypatch.setattr(StageStreams, "_hold", forgetful)
    pipe = make(schedule)
    backend = recording_streams(pipe)
    for x, y in batches(4):
        pipe.step(x, y)
    assert backend.early_frees, "a storage freed before its reader was joined went unseen"
    assert backend.violations, "a block reused before its reader was done went unseen"


def test_a_free_into_the_callers_pool_before_the_join_is_found() -> None:
    """The recorder's caller-side rule: inputs (made on the caller's stream) freed while
    stage 0's stream, which read them, is not joined."""
    pipe = make("pb")
    backend = recording_streams(pipe)
    streams = pipe.parts.executor.streams
    streams.wait_caller()
    x = torch.randn(3, D)
    streams.from_caller([x], [0])
    with streams.on(0):
        x.sum()
    streams.memory_held.clear()
    del x
    assert backend.violations and backend.early_frees


def test_an_exception_mid_step_keeps_hand_overs_safe() -> None:
    """An asynchronous step stopped by an exception inside an action, then continued: no
    unsafe free, no record_stream, the held memory is released once a later join saw it."""
    pipe = make("pb")
    backend = recording_streams(pipe)
    lonely = _watch_step_starts(pipe)
    data = batches(6)
    pipe.step(*data[0])
    calls = {"n": 0}

    def hook(stage: int, kind: str, mb: int) -> None:
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("injected")

    pipe.parts.executor.action_hook = hook
    with pytest.raises(RuntimeError, match="injected"):
        pipe.step(*data[1])
    pipe.parts.executor.action_hook = None
    for x, y in data[2:]:
        pipe.step(x, y)
    pipe.flush()
    pipe.step(*data[0])
    assert backend.counts["record_stream"] == 0
    assert backend.violations == [] and backend.early_frees == []
    assert lonely and all(n == 0 for n in lonely[3:]), lonely  # after the next join: released


def test_a_rolled_back_synchronous_step_keeps_hand_overs_safe() -> None:
    pipe = make("1f1b")
    backend = recording_streams(pipe)
    data = batches(4)
    pipe.step(*data[0])
    calls = {"n": 0}

    def hook(stage: int, kind: str, mb: int) -> None:
        calls["n"] += 1
        if calls["n"] == 9:
            raise RuntimeError("injected")

    pipe.parts.executor.action_hook = hook
    with pytest.raises(RuntimeError, match="injected"):
        pipe.step(*data[1])
    pipe.parts.executor.action_hook = None
    for x, y in data[1:]:
        pipe.step(x, y)
    assert backend.counts["record_stream"] == 0
    assert backend.violations == [] and backend.early_frees == []


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["pb", "1f1b"])
def test_cuda_stage_streams_equal_one_stream_and_hold_no_more_than_a_step(schedule: str) -> None:
    """On a GPU: stage streams (hand-overs held, no record_stream) equal one stream bit for
    bit through steps and a flush, and the memory allocated after each step does not grow."""
    kw = {"on_nonfinite": "skip_update"} if schedule == "pb" else {}
    torch.manual_seed(0)
    on = _cuda(schedule, True, **kw)
    off = _cuda(schedule, False, **kw)
    assert on.parts.executor.streams.separate and not off.parts.executor.streams.separate
    after = []
    for x, y in batches(10):
        x, y = x.cuda(), y.cuda()
        assert torch.equal(on.step(x, y), off.step(x, y))
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    a, b = on.flush(), off.flush()
    assert (a is None and b is None) or torch.equal(a, b)
    for sa, sb in zip(on.stages, off.stages, strict=True):
        for fa, fb in zip(sa.store.live_flats(), sb.store.live_flats(), strict=True):
            assert torch.equal(fa, fb)
    assert max(after[4:]) == max(after[3:5]), after  # steady: no growth after warm-up


def _cuda(schedule: str, streams: bool, **kw) -> engine.Pipeline:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    mods.append(nn.Linear(D, 2))
    return engine.Pipeline(
        [m.cuda() for m in mods], schedule=schedule, chunks=M, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9), checkpoint="never",
        cuda_streams=streams, **kw,
    )


@pytest.mark.parametrize("kw", [{}, {"on_nonfinite": "skip_update"}], ids=["pb", "pb-skip_update"])
def test_an_in_flight_load_runs_on_the_stage_streams(kw: dict) -> None:
    """load_state_dict of an unflushed pipeline re-runs the stashed forwards: with stage
    streams on each stage's stream, after the caller's writes, joined back (a fork-join of
    the caller's stream), its restored tensors held like hand-overs; the run goes on equal
    to the pipeline never saved, bit for bit."""
    data = batches(7)
    kw = {**kw, "checkpoint": "always"}  # (an unflushed pb state re-runs its forwards)
    a = make("pb", **kw)
    for x, y in data[:3]:
        a.step(x, y)
    state = a.state_dict()
    b = make("pb", **kw)
    backend = recording_streams(b)
    with backend.fork_join() as found:
        b.load_state_dict(state)
    assert found == []
    assert all(st.work > 0 for st in pipe_streams(b))  # the re-runs ran on the stage streams
    for x, y in data[3:]:
        assert torch.equal(a.step(x, y), b.step(x, y))
    la, lb = a.flush(), b.flush()
    assert (la is None and lb is None) or torch.equal(la, lb)
    assert backend.counts["record_stream"] == 0
    assert backend.violations == [] and backend.early_frees == []
