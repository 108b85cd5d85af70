"""The executor of one process: every stage's actions in the program's merged order.

Why a module: the step's rules (segments, the synchronous commit and its rollback point,
Ctrl-C, the non-finite policy, the notes) are the protocol's (:mod:`~engine.runtime.exec.protocol`);
what this file adds is how one process holding every stage runs a compiled step program
(:mod:`~engine.runtime.exec.program`): ``prog.local``, forwards and backwards handing tensors to
their neighbours through in-process mailboxes (with CUDA events between per-stage streams),
backwards that are ready together batched into one autograd call -- and what an exception
raised inside one of those actions drops (an asynchronous step; docs/ALGORITHMS.md,
"Exceptions inside a step"):

* a forward: its micro-batch, at every stage (as a non-finite loss would be);
* a backward (or a batch of them): its micro-batch, and the gradients its stage had
  accumulated for the current update (partial sums cannot be told apart);
* a weight gradient W: the stage's weight sums for its current update (the input gradient
  already left);
* an update: skipped.

Under gloo/NCCL a rank runs its own lane instead (:class:`~engine.runtime.ranks.rank.RankLane`).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import torch

from engine.runtime.stage import labels
from engine.runtime.stage import trace as _trace
from engine.runtime.exec.failures import Outcome, discard_partial
from engine.runtime.exec.program import BB, OP_NAMES, B, F, StepProgram, U, W
from engine.runtime.exec.protocol import StepProtocol
from engine.runtime.exec.result import StepResult, _Input  # StepResult: re-exported
from engine.runtime.stage.stage import DROPPED, Stage
from engine.runtime.exec.streams import StageStreams
from engine.schedule.spec import ScheduleSpec

__all__ = ["Executor", "MergedOrder", "StepResult"]

_NO_ACTIVE: dict[int, tuple[int, str]] = {}


class Executor(StepProtocol):
    """The step protocol over every stage in one process, run in merged order (module
    docstring; arguments: :class:`~engine.runtime.exec.protocol.StepProtocol`)."""

    def __init__(
        self,
        spec: ScheduleSpec,
        stages: list[Stage],
        *,
        on_nonfinite: str,
        streams: StageStreams,
        device_flags: bool = False,
    ) -> None:
        super().__init__(
            spec, stages, on_nonfinite=on_nonfinite, streams=streams, device_flags=device_flags
        )
        self.runner: MergedOrder = MergedOrder(self)

    @property
    def chain_sync(self) -> bool:
        """Whether synchronous steps chain the stages' graphs (:meth:`MergedOrder.prepare_sync`)."""
        return self.runner.chain_sync


class MergedOrder:
    """The runner of one process holding every stage (module docstring)."""

    stops_between_actions = True

    def __init__(self, p: StepProtocol) -> None:
        self.p = p
        self.pc = 0
        self.in_action = False
        #: synchronous steps chain the stages' graphs (one process holds every stage), unless
        #: the schedule splits backwards into B and W: those run per stage, as scheduled
        self.chain_sync = len(p.stages) == p.spec.stages and not p.spec.split_backward

    # ------------------------------------------------------------------ the protocol's calls

    def begin(self) -> None:
        """Nothing to announce before a step in one process."""

    def feed(self, xs: list[Any], targets: list[Any], samples: list[int], base: int) -> None:
        p = self.p
        S, held = p.S, p.by_index
        readers = sum(1 for s in (0, S - 1) if s in held) if S > 1 else 1
        p.streams.wait_caller()
        # stage 0 reads the inputs, the last stage the targets (and nobody else either)
        p.streams.from_caller(xs, [0] if 0 in held else [])
        p.streams.from_caller(targets, [S - 1] if S - 1 in held else [])
        for i, (x, t, b) in enumerate(zip(xs, targets, samples, strict=True)):
            p.inputs[base + i] = _Input(x, t, b, readers)

    def prepare_sync(self) -> None:
        """One autograd call per micro-batch through every stage (no update happens inside a
        synchronous step, so chaining the stages' graphs computes exactly what per-stage
        backwards compute); while profiling or tracing, per-stage backwards keep their labels.

        Never with stage streams: autograd orders a backward's gradient accumulation only
        with the stream that called it, so a chain called on the last stage's stream left
        each earlier stage's update (on its own stream) unordered after its gradients -- a
        race (1f1b and gpipe with ``cuda_streams=True``, captured or eager, differed from one
        stream on a GPU). Each stage then calls its own
        backward on its own stream, the gradient handed over with an event, as pb does."""
        stages = self.p.stages
        chain = (self.chain_sync and not self.p.streams.separate and not labels.profiling()
                 and _trace.ACTIVE is None)
        for st in stages:
            st.chain = chain
            # a chained backward runs through every stage: all take fresh gradients
            st.store.fresh.peers = tuple(x.store.fresh for x in stages if x is not st) if chain else ()

    def run(self, prog: StepProgram, start: int, base: int, updates: bool) -> None:
        self._loop(prog.local, start, base)

    def action(self, prog: StepProgram, pc: int) -> tuple[int, int, Any] | None:
        return prog.local[pc] if pc < len(prog.local) else None

    def recoverable(self, exc: BaseException) -> bool:
        return True

    def share(self, result: StepResult) -> StepResult:
        return result

    def end_sync(self) -> None:
        """Nothing in flight between processes."""

    def end_drain(self) -> None:
        """Nothing in flight between processes."""

    def clear(self) -> None:
        """The mailboxes are the protocol's (cleared by its rollback)."""

    def reported(self) -> Any:
        return nullcontext()

    def take_failure(self) -> BaseException | None:
        """Nothing is gone past in one process: an exception pauses the step at once."""
        return None

    # ------------------------------------------------------------------ running

    def _loop(self, ins: tuple[tuple[int, int, Any], ...], start: int, base: int) -> None:
        p = self.p
        by_index = p.by_index
        streams = p.streams
        cuda = streams.separate  # per-stage streams (CUDA, or a recording fake)
        clock = p.clock
        interrupts = p.interrupts
        hook = p.action_hook
        log = p.log
        n_base = p.n_base
        perf = time.perf_counter
        for pc in range(start, len(ins)):
            self.pc = pc
            self.in_action = False
            op, s, rel = ins[pc]
            if interrupts.pending:
                interrupts.check()
            if op == BB:
                if hook is not None:
                    for s2, r2 in rel:
                        hook(s2, "B", n_base + base + r2)
                self.in_action = True
                if log is not None:
                    log.extend((s2, p.action_of(B, r2, base)) for s2, r2 in rel)
                t0 = perf()
                self._backward_batch(rel, base)
                share = (perf() - t0) / len(rel)
                for s2, r2 in rel:
                    clock.record(s2, B, n_base + base + r2, share)
                continue
            if hook is not None:
                hook(s, OP_NAMES[op], n_base + base + (rel if op != U else rel[-1]))
            st = by_index[s]
            self.in_action = True
            if log is not None:
                log.append((s, p.action_of(op, rel, base)))
            if op == U:
                if cuda:
                    with streams.on(s):
                        st.update()
                else:
                    st.update()
                continue
            i = base + rel
            t0 = perf()
            if cuda:
                with streams.on(s):
                    events = p.cuda_events
                    if events is not None:
                        begin = torch.cuda.Event(enable_timing=True)
                        begin.record()
                    bad = self._compute(st, op, i)
                    if events is not None:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        events.append((s, OP_NAMES[op], n_base + i, begin, end))
            else:
                bad = self._compute(st, op, i)
            clock.record(s, op, n_base + i, perf() - t0)
            if bad:
                self.in_action = False
                self.pc = pc + 1
                raise p.nonfinite_error([n_base + i])
        self.pc = len(ins)
        self.in_action = False

    def _compute(self, st: Stage, op: int, i: int) -> bool:
        """F, B or W of micro-batch i on ``st``; True when a non-finite loss must raise now."""
        if op == F:
            return self._forward(st, i)
        if op == W:
            st.backward_weight(i, self.p.n_base + i)
            return False
        return self._backward(st, i)

    def _forward(self, st: Stage, i: int) -> bool:
        """F(i) on ``st``; True when its loss is non-finite and that must raise now."""
        p = self.p
        s = st.index
        last = st.is_last
        inp = p.take_input(i) if (s == 0 or last) else None
        if s == 0:
            x = inp.x  # type: ignore[union-attr]
        else:
            x, ev = p.acts.pop((s, i))
            p.streams.wait(s, ev, x)
        target = inp.target if (last and inp is not None) else None
        n = p.n_base + i
        out, loss = st.forward(i, n, x, target, p.scale)
        if not last:
            p.acts[(s + 1, i)] = (out, p.streams.record(s) if out is not DROPPED else None)
            return False
        if loss is None or inp is None:
            return False
        p.losses.append((n, loss, inp.samples))
        if p.flags is not None:  # no host read: the flag skips the updates on the device
            p.streams.shared(p.flags.mark(p.stages, i, loss), s)
            return False
        if not p.immediate_nonfinite or math.isfinite(loss.item()):
            return False
        p.drop_everywhere(i)
        return p.on_nonfinite == "raise"

    def _backward(self, st: Stage, i: int) -> bool:
        p = self.p
        s = st.index
        n = p.n_base + i
        if st.chain:  # the last stage's backward runs every stage's (module docstring)
            if st.is_last:
                labels.ACTIVE = {x: (n, "B") for x in p.by_index}
            try:
                st.backward(i, n, None)
            finally:
                labels.ACTIVE = _NO_ACTIVE
            return False
        if st.is_last:
            grad = None
        else:
            grad, ev = p.grads.pop((s, i))
            p.streams.wait(s, ev, grad)
        gin = st.backward(i, n, grad)
        if s > 0:
            p.grads[(s - 1, i)] = (gin, p.streams.record(s) if gin is not DROPPED else None)
        return False

    def _backward_batch(self, items: tuple[tuple[int, int], ...], base: int) -> None:
        """Several stages' backwards (different stages, independent) in one autograd call;
        while profiling each runs on its own so every one keeps its profiler label."""
        p = self.p
        if labels.profiling() or p.streams.separate or _trace.ACTIVE is not None:
            try:
                for s, rel in items:
                    st = p.by_index[s]
                    if p.streams.separate:
                        with p.streams.on(s):
                            self._backward(st, base + rel)
                    else:
                        self._backward(st, base + rel)
            except BaseException:
                self._batch_failed(items, base)  # as the one autograd call below would
                raise
            return
        jobs = []
        upstream: list[tuple[Stage, int, Any]] = []
        n_base = p.n_base
        active = {}
        try:
            for s, rel in items:
                st = p.by_index[s]
                i = base + rel
                grad = None if st.is_last else p.grads.pop((s, i))[0]
                job = st.begin_backward(i, n_base + i, grad)
                if job is None or job is DROPPED:
                    upstream.append((st, i, job))
                else:
                    jobs.append(job)
                    active[s] = (n_base + i, "B")
            labels.ACTIVE = active
            try:
                Stage.run_backward(jobs[0].stage, jobs) if jobs else None
            finally:
                labels.ACTIVE = _NO_ACTIVE
                for job in jobs:
                    job.stage.end_backward(job)
        except BaseException:
            self._batch_failed(items, base)
            raise
        for job in jobs:
            upstream.append((job.stage, job.i, job.stage.finish_backward(job)))
        for st, i, gin in upstream:
            if st.index > 0:
                p.grads[(st.index - 1, i)] = (gin, None)

    # ------------------------------------------------------------------ failures

    def failed(self, prog: StepProgram, base: int, exc: BaseException) -> None:
        """An exception raised inside the action at ``pc`` (asynchronous step): drop what it
        touched (module docstring) and say so in its note."""
        p = self.p
        action = prog.local[self.pc]
        op, s, rel = action
        if op == BB:  # _backward_batch already dropped every micro-batch in the batch
            p.note_outcome(exc, action, base, Outcome.BACKWARD_FAILED)
            return
        st = p.by_index[s]
        if op == U:
            p.note_outcome(exc, action, base, Outcome.UPDATE_SKIPPED)
            return
        i = base + rel
        if op == W:  # B already sent the input gradient: only the weight sums are lost
            self._discard(st)
            p.dropped += 1
            p.note_outcome(exc, action, base, Outcome.WEIGHT_GRADIENT_FAILED)
        elif op == F:
            st.drop_forward(i, p.n_base + i, p.scale)
            if not st.is_last:
                p.acts[(s + 1, i)] = (DROPPED, None)
            p.dropped += 1
            p.note_outcome(exc, action, base, Outcome.DROPPED)
        else:
            self._backward_dropped(st, i)
            p.note_outcome(exc, action, base, Outcome.BACKWARD_FAILED)

    def _batch_failed(self, items: tuple[tuple[int, int], ...], base: int) -> None:
        """A batched backward raised: every micro-batch in it is dropped at its stage."""
        p = self.p
        for s, rel in items:
            st = p.by_index[s]
            i = base + rel
            if st.stash.get(i) is not None:  # its backward had not begun
                st.stash.pop(i)
                st.pending += 1
                st.pending_mbs.append(p.n_base + i)
                p.grads.pop((s, i), None)
            self._backward_dropped(st, i)

    def _backward_dropped(self, st: Stage, i: int) -> None:
        """Micro-batch i's backward at ``st`` failed: its update group loses the gradients
        accumulated so far, and the stage before sees the micro-batch as dropped."""
        self._discard(st)
        if st.index > 0:
            self.p.grads[(st.index - 1, i)] = (DROPPED, None)
        self.p.dropped += 1

    def _discard(self, st: Stage) -> None:
        discard_partial(st, self.p.streams)
