"""Runs the stages' action streams (the schedule IR's, unchanged) over a transport, and keeps the clock.

The executor owns the *segment* (micro-batches since the last flush), the stages this process
holds (all S under the "local" transport, one under gloo/NCCL) and the engine's own clock.
Each stage pulls its actions from :func:`engine.schedule.stage_actions`: F/B/U run on the
stage, SF/SB hand the output to the transport, RF/RB take the input from it.

Local execution order across stages is free as long as each stage's own order is kept and
data dependencies are met, so the loop runs every stage as far as it can until nothing can
progress; results do not depend on where it pauses (updates of stage s touch only stage s).
Under a blocking transport every rank stops at the same point of its stream: before the
forward (or its receive) of a micro-batch that has not been fed yet. Every backward a stage
can reach before that point is one its downstream neighbour also reaches before its own stop
(in 1F1B and dataflow order a stage's backwards trail its neighbour's), so blocking receives
never wait for a message that the current call will not produce.

The clock: every action gets a start time max(stage free, producer finished) and a cost, once
with unit costs (F = 1, B = 2; the bubble formulas of ALGORITHMS.md hold for any fixed ratio)
and once with the measured wall time of the action. Inputs count as available at once, so
pauses between ``step()`` calls never show up as bubbles; synchronous steps start after the
previous step's last action (their flush). With one stage per process the clock sees only
its own stage, so the pipeline reports no bubble fraction there.

CUDA (local transport with ``streams``): each stage's actions are enqueued on its own stream;
the transport orders the hand-offs with events (see transport/local.py), inputs fed from the
caller's stream are waited for by stage 0 and the last stage, and the caller's stream waits
for every stage stream before it reads losses (:meth:`Executor.join_streams`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from engine.runtime.errors import NonFiniteLossError
from engine.runtime.probe import profiling
from engine.runtime.stage import DROPPED, Stage
from engine.runtime.transport.base import Transport
from engine.runtime.transport.local import LocalTransport
from engine.schedule.ir import Action, Kind
from engine.schedule.streams import SYNCHRONOUS, stage_actions

__all__ = ["Executor", "Clock"]

_COST = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}
_NO_LABEL = contextlib.nullcontext()


class Clock:
    """Discrete-event clock of one run: busy time per stage and makespan."""

    def __init__(self, S: int, local: set[int] | None = None) -> None:
        self.S = S
        #: stages whose actions this clock sees; a finish time is kept for a neighbour only
        #: if that neighbour is local (under gloo/NCCL nobody would ever collect it)
        self.local = set(range(S)) if local is None else set(local)
        self.reset()

    def reset(self) -> None:
        self.free = [0.0] * self.S
        self.busy = [0.0] * self.S
        self.done: dict[tuple[int, str, int], float] = {}
        self.start: float | None = None
        self.end = 0.0
        self.barrier = 0.0

    def record(self, s: int, kind: str, n: int, cost: float) -> None:
        dep = 0.0
        if kind == "F" and s > 0:
            dep = self.done.pop((s - 1, "F", n), 0.0)
        elif kind == "B" and s < self.S - 1:
            dep = self.done.pop((s + 1, "B", n), 0.0)
        begin = max(self.free[s], dep, self.barrier)
        if self.start is None:
            self.start = begin
        finish = begin + cost
        self.free[s] = finish
        self.busy[s] += cost
        self.end = max(self.end, finish)
        if (kind == "F" and s + 1 in self.local) or (kind == "B" and s - 1 in self.local):
            self.done[(s, kind, n)] = finish

    def sync_barrier(self) -> None:
        """A flush: the next actions start after everything so far."""
        self.barrier = self.end

    def bubble(self) -> float:
        if self.start is None or self.end <= self.start:
            return 0.0
        span = self.end - self.start
        return 1.0 - sum(self.busy) / (self.S * span)


@dataclasses.dataclass
class _Input:
    x: Tensor | None
    target: Any
    scale: float
    samples: int
    readers: set[int]  # local stages (0 and/or S-1) that still have to read it


class _Stream:
    """A stage's action stream with look-ahead (one action to run; more to plan receives)."""

    def __init__(self, it: Iterator[Action]) -> None:
        self._it = it
        self._ahead: collections.deque[Action] = collections.deque()

    def peek(self) -> Action:
        if not self._ahead:
            self._ahead.append(next(self._it))  # streams never end
        return self._ahead[0]

    def advance(self) -> None:
        self._ahead.popleft()

    def upcoming(self, limit: int) -> Iterator[Action]:
        """The next ``limit`` actions after the one being run, without consuming them."""
        while len(self._ahead) < limit:
            self._ahead.append(next(self._it))
        return itertools.islice(self._ahead, limit)


class _Upstream:
    """Stage s-1's action stream, read as far as the activations stage s has received: which
    gradients stage s-1 has certainly consumed by then.

    Stage s receives the activations in the order stage s-1 sends them (FIFO channel). When
    the activation of micro-batch m arrives, stage s-1 has run every action before ``SF m`` in
    its stream, in particular every ``B n`` there, and a backward runs only after its
    gradient's receive returned. Those gradients (sent by stage s) have left, so their send
    handles can be released. A receive stage s-1 merely posted ahead is not counted: only
    ``B`` actions are.
    """

    def __init__(self, it: Iterator[Action], stage: int) -> None:
        self._it = it
        self._stage = stage  # the upstream stage whose stream this reads

    def consumed(self, m: int) -> list[int]:
        """Micro-batches whose backward stage s-1 ran since the previous ``SF`` up to
        ``SF m``, which must be the next activation send of the stream."""
        out: list[int] = []
        for act in self._it:  # streams never end
            if act.kind is Kind.BACKWARD:
                out.append(act.mb)
            elif act.kind is Kind.SEND_ACT:
                if act.mb != m:
                    raise RuntimeError(
                        f"stage {self._stage + 1} received activation {m} where stage "
                        f"{self._stage}'s stream sends {act.mb} next; "
                        "channels are FIFO in stream order"
                    )
                return out
        raise AssertionError("streams never end")


class Executor:
    """Execution of one schedule over the stages this process holds.

    Args:
        stages: the Stage objects held here, each knowing its ``index``.
        S: the pipeline's number of stages.
        schedule, M, k, order: the schedule of :func:`engine.schedule.stage_actions`.
        on_nonfinite: "raise" or "skip" (see ``Pipeline.step``).
        transport: how SF/RF/SB/RB move tensors (default: in-process mailboxes).
        streams: CUDA stream per stage index (local transport on one GPU), or None.
    """

    def __init__(
        self,
        stages: list[Stage],
        schedule: str,
        M: int,
        k: int,
        order: str | None,
        on_nonfinite: str,
        *,
        S: int | None = None,
        transport: Transport | None = None,
        streams: dict[int, Any] | None = None,
    ) -> None:
        self.stages = stages
        self.S = len(stages) if S is None else S
        self.by_index = {st.index: st for st in stages}
        self.schedule = schedule
        self.sync = schedule in SYNCHRONOUS
        self.M = M
        self.k = k
        self.order = order
        self.on_nonfinite = on_nonfinite
        self.streams = streams
        self.transport: Transport = (
            transport
            if transport is not None
            else LocalTransport(None if streams is None else [streams[s] for s in range(self.S)])
        )
        self.blocking = self.transport.blocking
        # a non-finite loss is acted on at once only where dropping it per micro-batch is
        # possible without a host sync per forward: CPU, all stages here. Otherwise the check
        # happens once per step (see Pipeline.step).
        self.defer_nonfinite = self.blocking or (streams is not None and self.sync)
        self.unit_clock = Clock(self.S, set(self.by_index))
        self.wall_clock = Clock(self.S, set(self.by_index))
        self.n_base = 0  # global id of the next segment's first micro-batch
        self.dropped = 0  # micro-batches whose loss was not finite, over the whole run
        self.active = False
        self.cuda_events: list[tuple[int, str, int, Any, Any]] | None = None
        #: when a list: every action executed, as (stage, Action with global micro-batch ids)
        self.log: list[tuple[int, Action]] | None = None
        self._reset_segment()

    # ------------------------------------------------------------------ segments

    def _reset_segment(self) -> None:
        self.inputs: dict[int, _Input] = {}
        self.fed = 0
        self.draining = False
        self.N = 0
        self.received: dict[tuple[int, int], Any] = {}  # (stage, mb) -> activation
        self.grads_in: dict[tuple[int, int], Any] = {}  # (stage, mb) -> gradient from s+1
        self.outbox: dict[tuple[str, int, int], Any] = {}  # (channel, stage, mb) -> to send
        self.b_done = dict.fromkeys(self.by_index, 0)
        self.f_done = dict.fromkeys(self.by_index, 0)
        self.streams_: dict[int, _Stream] = {}
        self.upstream: dict[int, _Upstream] = {}  # stage -> stage s-1's stream (blocking)
        self.losses: list[tuple[int, Tensor, int]] = []
        self.nonfinite: list[int] = []
        if isinstance(self.transport, LocalTransport):
            self.transport.clear()

    def open_segment(self) -> None:
        """Start a new segment: streams restart at micro-batch 0 (fill after a flush)."""
        self._reset_segment()
        for st in self.stages:
            st.segment_updates = st.updates
        self.streams_ = {
            st.index: _Stream(
                stage_actions(self.schedule, st.index, self.S, self.M, self.k, self.order)
            )
            for st in self.stages
        }
        if self.blocking:
            # sent gradients are released once stage s-1's stream proves them consumed
            self.upstream = {
                s: _Upstream(
                    stage_actions(self.schedule, s - 1, self.S, self.M, self.k, self.order), s - 1
                )
                for s in self.by_index
                if s > 0
            }
        self.active = True

    def feed(
        self,
        xs: list[Tensor | None],
        targets: list[Any],
        scales: list[float],
        samples: list[int],
    ) -> None:
        readers = {s for s in (0, self.S - 1) if s in self.by_index}
        if self.streams is not None:
            # the caller's stream produced the inputs and may have written weights (init,
            # load_state_dict): every stage stream starts after it
            caller = torch.cuda.current_stream()
            for stream in self.streams.values():
                stream.wait_stream(caller)
        for x, t, sc, b in zip(xs, targets, scales, samples, strict=True):
            if self.streams is not None:
                for s in readers:
                    for v in (x, t):
                        if isinstance(v, Tensor) and v.is_cuda:
                            v.record_stream(self.streams[s])
            if readers:  # a middle stage under gloo/NCCL reads no inputs: keep nothing
                self.inputs[self.fed] = _Input(x, t, sc, b, set(readers))
            self.fed += 1

    def in_flight(self) -> int:
        """Micro-batches fed in this segment whose backward has not finished on the first stage
        held here, plus gradients not yet applied."""
        if not self.active:
            return 0
        pending = any(st.pending for st in self.stages)
        first = min(self.by_index)
        return self.fed - self.b_done[first] + (1 if pending else 0)

    def close_segment(self) -> None:
        self.n_base += self.fed
        self.active = False
        for st in self.stages:
            st.store.unhold_all("2bw")
        self._reset_segment()

    # ------------------------------------------------------------------ CUDA streams

    def on_stage(self, s: int) -> contextlib.AbstractContextManager[Any]:
        """Enqueue on stage ``s``'s CUDA stream (a no-op without streams)."""
        if self.streams is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams[s])

    def join_streams(self) -> None:
        """Make the caller's stream wait for every stage stream (before it reads results)."""
        if self.streams is None:
            return
        cur = torch.cuda.current_stream()
        for stream in self.streams.values():
            cur.wait_stream(stream)

    def update_stage(self, st: Stage) -> None:
        """U on ``st`` (on its stream), for the synchronous step's deferred update."""
        self._log_update(st)
        with self.on_stage(st.index):
            st.update()

    def _log_update(self, st: Stage) -> None:
        if self.log is not None and st.pending_mbs:
            self.log.append((st.index, Action.update(st.pending_mbs)))

    def _log(self, s: int, act: Action) -> None:
        if self.log is not None:
            self.log.append((s, Action(act.kind, (self.n_base + act.mb,))))

    # ------------------------------------------------------------------ running

    def _ready(self, s: int, act: Action) -> bool | None:
        """True: run it; False: blocked; None: skip it (deferred or filtered by the drain)."""
        kind = act.kind
        if kind is Kind.UPDATE:
            if self.sync:
                return None  # the pipeline updates after checking the step's losses
            return True if self.by_index[s].pending else None
        i = act.mb
        if self.draining and i >= self.N:
            return None
        if kind is Kind.FORWARD:
            return i < self.fed if s == 0 else (s, i) in self.received
        if kind is Kind.RECV_ACT:
            if self.blocking:
                return i < self.fed  # stop before micro-batches not fed yet
            x = self.transport.recv("act", s, i)
            if x is None:
                return False
            self.received[(s, i)] = x
            self._log(s, act)
            return None  # received: nothing more to run
        if kind is Kind.BACKWARD:
            return True if s == self.S - 1 else (s, i) in self.grads_in
        if kind is Kind.RECV_GRAD:
            if self.blocking:
                return True
            g = self.transport.recv("grad", s, i)
            if g is None:
                return False
            self.grads_in[(s, i)] = g
            self._log(s, act)
            return None
        return True  # sends never block

    def _finished(self, s: int) -> bool:
        """Drained: every backward done and its gradient sent (SB follows B in the stream)."""
        return (
            self.draining
            and self.b_done[s] >= self.N
            and not any(key[1] == s for key in self.outbox)
        )

    def run(self) -> None:
        """Run every stage as far as it can. Raises NonFiniteLossError (after keeping the
        stage state consistent) when a loss is not finite and on_nonfinite == "raise"."""
        error: NonFiniteLossError | None = None
        progress = True
        while progress:
            progress = False
            for st in self.stages:
                s = st.index
                stream = self.streams_[s]
                while not self._finished(s):
                    act = stream.peek()
                    ready = self._ready(s, act)
                    if ready is False:
                        break
                    stream.advance()
                    progress = True
                    if ready is None:
                        continue
                    err = self._execute(s, act)
                    if err is not None and error is None:
                        error = err
                    if error is not None and self.sync:
                        raise error
                if self._finished(s) and st.pending and not self.sync:
                    self._log_update(st)
                    with self.on_stage(s):  # flush: apply the partial group, drop nothing
                        st.update()
                    progress = True
            if error is not None:
                raise error

    def _blocking_recv(self, channel: str, s: int, i: int) -> Any:
        """RF/RB under a blocking transport, telling it how far this call certainly receives
        on the channel (so it may post those receives ahead, see transport/p2p.py): every
        activation of a fed micro-batch (ranks stop only before an unfed one's forward); while
        draining every gradient below N; otherwise (an asynchronous step) the gradients whose
        RB comes before this call's stopping point in the stage's stream."""
        if channel == "act":
            certain = min(self.fed, self.N) if self.draining else self.fed
        elif self.draining:
            certain = self.N
        else:
            certain = self._grads_before_stop(s, i)
        got = self.transport.recv(channel, s, i, certain)
        if channel == "act" and s in self.upstream:
            # the gradients stage s-1 consumed before sending this activation have left
            self.transport.release("grad", self.upstream[s].consumed(i))
        return got

    #: how far ahead in a stream to look for receives to post (actions)
    LOOKAHEAD = 16

    def _grads_before_stop(self, s: int, i: int) -> int:
        """1 + the last RB of stage ``s`` among the next actions that this call will run for
        sure: a blocking rank runs its stream until the forward (or its receive) of a
        micro-batch not fed yet, and nothing else stops it."""
        last = i
        for act in self.streams_[s].upcoming(self.LOOKAHEAD):
            kind = act.kind
            if kind is Kind.RECV_ACT or (kind is Kind.FORWARD and s == 0):
                if act.mb >= self.fed:
                    break
            elif kind is Kind.RECV_GRAD:
                last = act.mb
        return last + 1

    def _input(self, s: int, i: int) -> _Input:
        inp = self.inputs[i]
        inp.readers.discard(s)
        if not inp.readers:
            del self.inputs[i]
        return inp

    def _execute(self, s: int, act: Action) -> NonFiniteLossError | None:
        kind = act.kind
        i = act.mb if kind is not Kind.UPDATE else -1
        if kind is Kind.UPDATE:
            self._log_update(self.by_index[s])
        else:
            self._log(s, act)
        if kind.is_comm:
            label = (
                record_function(f"stage{s}/{kind.value}{self.n_base + i}")
                if profiling()
                else _NO_LABEL
            )
            with label:
                if kind is Kind.SEND_ACT:
                    self.transport.send("act", s, i, self.outbox.pop(("act", s, i)))
                elif kind is Kind.SEND_GRAD:
                    self.transport.send("grad", s, i, self.outbox.pop(("grad", s, i)))
                elif kind is Kind.RECV_ACT:
                    self.received[(s, i)] = self._blocking_recv("act", s, i)
                else:
                    self.grads_in[(s, i)] = self._blocking_recv("grad", s, i)
            return None
        stage = self.by_index[s]
        if kind is Kind.UPDATE:
            with self.on_stage(s):
                stage.update()
            return None
        n = self.n_base + i
        t0 = time.perf_counter()
        err = None
        with self.on_stage(s):
            ev0 = self._event() if self.cuda_events is not None else None
            if kind is Kind.FORWARD:
                err = self._forward(stage, s, i, n)
            else:
                grad = None if s == self.S - 1 else self.grads_in.pop((s, i))
                gin = stage.backward(i, n, grad)
                self.b_done[s] += 1
                if s > 0:
                    self.outbox[("grad", s, i)] = gin if gin is not None else DROPPED
            if ev0 is not None and self.cuda_events is not None:
                self.cuda_events.append((s, kind.value, n, ev0, self._event()))
        wall = time.perf_counter() - t0
        self.unit_clock.record(s, kind.value, n, _COST[kind])
        self.wall_clock.record(s, kind.value, n, wall)
        return err

    @staticmethod
    def _event() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _forward(self, stage: Stage, s: int, i: int, n: int) -> NonFiniteLossError | None:
        last = s == self.S - 1
        inp = self._input(s, i) if (s == 0 or last) else None
        x = inp.x if s == 0 else self.received.pop((s, i))
        target = inp.target if last and inp is not None else None
        scale = inp.scale if inp is not None else self.scale
        out, loss = stage.forward(i, n, x, target, scale)
        self.f_done[s] += 1
        if not last:
            self.outbox[("act", s, i)] = out
            return None
        assert loss is not None and inp is not None
        self.losses.append((n, loss, inp.samples))
        if self.defer_nonfinite:
            return None  # checked once per step (Pipeline.step / check_losses)
        if bool(torch.isfinite(loss).all()):
            return None
        self.nonfinite.append(n)
        self.dropped += 1
        stage.drop(i)
        if self.on_nonfinite != "raise":
            return None
        return NonFiniteLossError(
            f"micro-batch {n} (#{i} of this {'mini-batch' if self.sync else 'segment'}) "
            f"gave a non-finite loss ({loss.item()}); "
            + (
                "the step was rolled back: no weight or optimizer state changed. "
                if self.sync
                else "it was dropped at every stage (zero gradient); earlier updates stand. "
            )
            + "Lower the learning rate, check the inputs, or pass on_nonfinite='skip'."
        )

    #: loss scale of a micro-batch on stages that do not see the inputs (set by the pipeline)
    scale: float = 1.0

    def check_losses(self) -> list[int]:
        """Deferred non-finite check: global ids of this step's non-finite micro-batches."""
        bad = [n for n, loss, _ in self.losses if not bool(torch.isfinite(loss).all())]
        self.nonfinite.extend(bad)
        self.dropped += len(bad)
        return bad

    def take_losses(self) -> tuple[Tensor | None, list[int]]:
        """Sample-weighted mean loss of the micro-batches computed since the last call."""
        losses, self.losses = self.losses, []
        self.join_streams()  # the caller reads results (losses, weights) after every stage
        if not losses:
            return None, []
        if self.streams is not None:
            cur = torch.cuda.current_stream()
            for _, loss, _ in losses:
                loss.record_stream(cur)  # allocated on the last stage's stream, read here
        total = sum(b for _, _, b in losses)
        value = sum(loss.double() * b for _, loss, b in losses) / total
        return value.float(), [n for n, _, _ in losses]

    def abort(self) -> None:
        """Roll back a failed synchronous step: no gradients, no stashed work."""
        for st in self.stages:
            st.discard_gradients()
            st.reset_in_flight()
        self.close_segment()
