"""Events per step with per-stage streams, counted on CPU (issue 23, item 3).

The executor's CUDA-streams path runs on a recording backend (engine.testing.stream_recorder)
that counts what CUDA would do. Each step must make exactly the schedule's cross-stream
dependencies: one event per hand-off between stages (an activation to the next stage, a
gradient to the previous one), one event on the caller's stream that every stage waits for
(inputs, weights the caller wrote), and one wait per stage for the caller before it reads
the losses; no polling; and no ``record_stream`` (the allocator's polled events): handed-over
tensors are held until the next step's start instead (tests/runtime/test_stream_memory.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.optim
from engine.testing.stream_recorder import recording_streams

S, M, D = 4, 4, 5


def make(schedule: str, stages: int = S, chunks: int = M, device: str = "cpu", **kw) -> engine.Pipeline:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(stages - 1)]
    mods.append(nn.Linear(D, 2))
    mods = [m.to(device) for m in mods]
    return engine.Pipeline(
        mods, schedule=schedule, chunks=chunks, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9),
        checkpoint="never", **kw,
    )


def batches(n: int, chunks: int = M) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(chunks, D, generator=g), torch.randn(chunks, 2, generator=g)) for _ in range(n)]


def expected(log: list, chained: bool) -> dict[str, int]:
    """What one step must cost, from the actions it ran (``executor.log``)."""
    kinds = [(s, a.kind.name) for s, a in log]
    forwards = [s for s, k in kinds if k == "FORWARD"]
    backwards = [s for s, k in kinds if k == "BACKWARD"]
    # an activation leaves every forward but the last stage's and enters every forward but
    # stage 0's; a gradient leaves every backward but stage 0's and enters all but the
    # last's -- unless a synchronous step chains its backwards in one autograd call
    sent = sum(s < S - 1 for s in forwards) + (0 if chained else sum(s > 0 for s in backwards))
    received = sum(s > 0 for s in forwards) + (0 if chained else sum(s < S - 1 for s in backwards))
    return {
        "event_record": sent + 1 + S,  # hand-offs, the caller's event, one per stage joined
        "event_wait": received + S + S,  # hand-offs, every stage waits for the caller, and the caller for every stage
    }


@pytest.mark.parametrize(
    ("schedule", "kw"),
    [("pb", {}), ("pb", {"order": "1f1b"}), ("1f1b", {}), ("gpipe", {}), ("pipedream", {}),
     ("zbh1", {}), ("pb", {"on_nonfinite": "skip_update"})],
    ids=["pb", "pb-1f1b-order", "1f1b", "gpipe", "pipedream", "zbh1", "pb-skip_update"],
)
def test_one_event_per_cross_stream_dependency(schedule: str, kw: dict) -> None:
    pipe = make(schedule, **kw)
    plain = make(schedule, **kw)  # the CPU stand-in: no streams at all
    backend = recording_streams(pipe)
    data = batches(4)
    for x, y in data[:3]:
        assert torch.equal(pipe.step(x, y), plain.step(x, y))
    backend.reset()
    pipe.parts.executor.log = []
    loss = pipe.step(*data[3])
    # stage streams never chain a synchronous step's backwards (Executor.prepare_sync: the
    # accumulation would be ordered with the last stage's stream only); the check can fail
    assert not any(st.chain for st in pipe.stages)
    assert dict(backend.counts) == expected(pipe.parts.executor.log, chained=False)
    assert backend.counts["event_query"] == 0 and backend.counts["synchronize"] == 0
    assert backend.violations == [] and backend.early_frees == []
    assert torch.equal(loss, plain.step(*data[3]))
    for a, b in zip(pipe.stages, plain.stages, strict=True):
        for fa, fb in zip(a.store.live_flats(), b.store.live_flats(), strict=True):
            assert torch.equal(fa, fb)


def test_waits_follow_the_pipeline() -> None:
    """Every hand-off wait connects neighbouring stages; the caller only meets all stages."""
    pipe = make("pb")
    backend = recording_streams(pipe)
    for x, y in batches(3):
        pipe.step(x, y)
    names = {st.index: backend_stream.name for st, backend_stream in
             ((st, pipe.parts.executor.streams.streams[st.index]) for st in pipe.stages)}
    index = {v: k for k, v in names.items()}
    for waiter, producer in backend.waits:
        if "caller" in (waiter, producer):
            continue
        assert abs(index[waiter] - index[producer]) == 1, (waiter, producer)


def test_pb_batch1_counts_per_step() -> None:
    """The issue's configuration (S=8, M=8): 112 hand-offs, then 1 + 8 records and 8 + 8
    waits between the caller and the stages. Before this test: a wait_stream per stage (8
    records where 1 does) and 136 record_stream (every received tensor, input, target and
    loss; each an allocator event polled with cudaEventQuery), now none."""
    pipe = make("pb", stages=8, chunks=8, on_nonfinite="skip_update")
    backend = recording_streams(pipe)
    data = batches(3, chunks=8)
    for x, y in data[:2]:
        pipe.step(x, y)
    backend.reset()
    pipe.step(*data[2])
    assert dict(backend.counts) == {
        "event_record": 112 + 1 + 8, "event_wait": 112 + 8 + 8,
    }


def _profiled_cuda_step(pipe: engine.Pipeline, x: torch.Tensor, y: torch.Tensor):
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe.step(x, y)
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events())
    records = sum(n for k, n in names.items() if k.startswith("cudaEventRecord"))
    return records, names["cudaStreamWaitEvent"], names["cudaEventQuery"]


@pytest.mark.cuda
def test_the_recording_backend_counts_what_cuda_does() -> None:
    """On a GPU: the profiler's CUDA runtime calls of one pb step (S=8, M=8) match the CPU
    count exactly -- records and waits -- and nothing polls an event (no tensor is handed to
    the allocator with record_stream, so it records and queries none)."""
    cpu = make("pb", stages=8, chunks=8, on_nonfinite="skip_update")
    backend = recording_streams(cpu)
    pipe = make("pb", stages=8, chunks=8, device="cuda", on_nonfinite="skip_update", cuda_streams=True)
    assert pipe.parts.executor.streams.cuda and pipe.parts.executor.streams.separate
    data = batches(3, chunks=8)
    for x, y in data[:2]:
        cpu.step(x, y)
        pipe.step(x.cuda(), y.cuda())
    backend.reset()
    cpu.step(*data[2])
    records, waits, queries = _profiled_cuda_step(pipe, data[2][0].cuda(), data[2][1].cuda())
    assert waits == backend.counts["event_wait"], (records, waits, queries)
    assert records == backend.counts["event_record"], (records, waits, queries)
    assert queries == 0  # no record_stream: the allocator records and polls no event


def test_stage_streams_are_off_by_default_on_one_gpu() -> None:
    """The default follows the measurements (H100, pb batch 1; engine.runtime.exec.streams.
    default_stage_streams): off eagerly (streams off 1.9x faster), on where asynchronous
    windows are captured (0.32-0.51x the time of one stream) and for l2_persistence, whose
    windows live on stage streams; never without a GPU."""
    from engine.runtime.exec.streams import default_stage_streams

    assert default_stage_streams(on_cuda=True, l2=False) is False
    assert default_stage_streams(on_cuda=True, l2=True) is True
    assert default_stage_streams(on_cuda=True, l2=False, captured_async=True) is True
    assert default_stage_streams(on_cuda=False, l2=False) is False
    assert default_stage_streams(on_cuda=False, l2=True, captured_async=True) is False


@pytest.mark.cuda
def test_a_gpu_pipeline_runs_on_one_stream_unless_asked() -> None:
    assert not make("pb", device="cuda").parts.executor.streams.separate
    assert make("pb", device="cuda", cuda_streams=True).parts.executor.streams.separate
    # captured asynchronous windows: stage streams by default; captured synchronous: not
    assert make("pb", device="cuda", cuda_graphs="program",
                on_nonfinite="skip_update").parts.executor.streams.separate
    assert not make("1f1b", device="cuda", cuda_graphs="program").parts.executor.streams.separate


@pytest.mark.parametrize("schedule", ["pb", "1f1b", "pipedream", "zbh1"])
def test_recorded_event_edges_are_exactly_the_hand_offs(schedule: str) -> None:
    """Each wait between stage streams is one hand-off of the step's program: F(i) at stage s
    waits for stage s-1's activation, B(i) at stage s for stage s+1's gradient -- the same
    multiset of (waiting stage, producing stage) edges as the actions the step ran."""
    from collections import Counter

    pipe = make(schedule)
    backend = recording_streams(pipe)
    data = batches(4)
    for x, y in data[:3]:
        pipe.step(x, y)
    backend.reset()
    pipe.parts.executor.log = []
    pipe.step(*data[3])
    index = {stream.name: s for s, stream in pipe.parts.executor.streams.streams.items()}
    got = Counter((index[w], index[p]) for w, p in backend.waits if "caller" not in (w, p))
    chained = any(st.chain for st in pipe.stages)  # (never, with stage streams)
    want: Counter = Counter()
    for s, a in pipe.parts.executor.log:
        if a.kind.name == "FORWARD" and s > 0:
            want[(s, s - 1)] += 1
        if a.kind.name == "BACKWARD" and s < S - 1 and not chained:
            want[(s, s + 1)] += 1
    assert got == want


# ---------------------------------------------------------------------- streams inside a graph


class ForkJoinTwin:
    """A capture backend that checks, on the recording streams, that every captured window
    is a fork-join of the caller's stream (what a CUDA graph with stage streams needs), then
    defers to ``inner`` (a CPU twin)."""

    def __init__(self, inner, backend) -> None:
        self.inner, self.backend = inner, backend
        self.runs_at_capture = getattr(inner, "runs_at_capture", False)
        self.reruns_host = getattr(inner, "reruns_host", False)
        self.windows = 0

    def capture(self, window):
        def checked() -> None:
            with self.backend.fork_join() as found:
                window()
            assert not found, found
            self.windows += 1

        return self.inner.capture(checked)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pb"])
def test_captured_windows_with_stage_streams_are_fork_joins(schedule: str, monkeypatch) -> None:
    """cuda_graphs="program" with stage streams (issue 23 item 2): each captured window forks
    every stage stream from the caller's stream and joins it back; its waits between stages
    are the hand-offs (test above); results equal the pipeline without streams bit for bit."""
    from engine.runtime.capture import synchronous as capture_mod
    from engine.runtime.capture.audit import _reference_optimizer
    from engine.runtime.capture.graph_twin import RecordingTwin, TapeTwin

    kw = {"on_nonfinite": "skip_update"} if schedule == "pb" else {}
    twin = TapeTwin() if schedule == "pb" else RecordingTwin()
    box: dict = {}

    class Late:  # the recording backend exists only once the pipeline is built
        runs_at_capture = getattr(twin, "runs_at_capture", False)
        reruns_host = getattr(twin, "reruns_host", False)

        def capture(self, window):
            return box["checked"].capture(window)

    with _reference_optimizer(), capture_mod.use_backend(Late()):
        pipe = make(schedule, cuda_graphs="program", **kw)
    plain = make(schedule, **kw)
    backend = recording_streams(pipe)
    box["checked"] = ForkJoinTwin(twin, backend)
    with _reference_optimizer():
        for x, y in batches(16):
            assert torch.equal(pipe.step(x, y), plain.step(x, y))
    cap = pipe.stats()["capture"]
    assert cap["captures"] >= 1 and cap["replays"] >= 2, cap
    assert box["checked"].windows >= 1
    with _reference_optimizer():
        pipe.flush()  # (pb: eager actions after replays, on the stage streams)
        plain.flush()
    # hand-overs held, not recorded, in and around the windows; none freed unsafely
    assert backend.counts["record_stream"] == 0
    assert backend.violations == [] and backend.early_frees == []
    for a, b in zip(pipe.stages, plain.stages, strict=True):
        for fa, fb in zip(a.store.live_flats(), b.store.live_flats(), strict=True):
            assert torch.equal(fa, fb)


def test_a_window_left_unjoined_is_found() -> None:
    pipe = make("pb")
    backend = recording_streams(pipe)
    streams = pipe.parts.executor.streams
    with backend.fork_join() as found:
        streams.wait_caller()
        with streams.on(0):
            pass
    assert found == [f"{streams.streams[0].name}'s last work is not joined to the caller"]
    with backend.fork_join() as found:
        with streams.on(1):
            pass
        streams.join()
    assert found == [f"{streams.streams[1].name} runs work before it waited for the caller"]


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pb"])
def test_cuda_captured_with_stage_streams_equals_eager(schedule: str) -> None:
    """On a GPU: stage streams inside the captured windows (concurrent branches) give the
    eager pipeline's results bit for bit, through a flush."""
    kw = {"on_nonfinite": "skip_update"} if schedule == "pb" else {}
    a = make(schedule, device="cuda", cuda_graphs="program", cuda_streams=True, **kw)
    b = make(schedule, device="cuda", **kw)
    assert a.parts.executor.streams.separate
    for x, y in batches(24):
        assert torch.equal(a.step(x.cuda(), y.cuda()), b.step(x.cuda(), y.cuda()))
    a.flush()
    b.flush()
    torch.cuda.synchronize()
    cap = a.stats()["capture"]
    assert cap["captures"] >= 1 and cap["replays"] >= 8, cap
    for p, q in zip(a.stages, b.stages, strict=True):
        for fa, fb in zip(p.store.live_flats(), q.store.live_flats(), strict=True):
            assert torch.equal(fa, fb)
