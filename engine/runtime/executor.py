"""The executor: runs compiled step programs and owns the step protocol.

Why here and not in ``Pipeline``: what happens in a step -- which program runs, the loss
check before a synchronous update, what a flush drains, what an exception leaves behind --
is one protocol. The facade only splits inputs and calls :meth:`Executor.run_step` /
:meth:`Executor.drain`.

Running. A *segment* is the stream of micro-batches since the last flush. Step j of a
segment runs ``compiler.step(j)`` (:mod:`~engine.runtime.program`); in one process every
stage's actions run in the program's merged order, forwards and backwards handing tensors to
their neighbours through in-process mailboxes (with CUDA events between per-stage streams);
under gloo/NCCL a rank runs its own stage's list (:mod:`~engine.runtime.rank`).

Exceptions (DESIGN.md: an exception inside ``step()``/``flush()`` leaves the pipeline
consistent and savable; docs/ALGORITHMS.md, "Exceptions inside a step"):

* A synchronous step is rolled back, whatever raised where before its update phase: no
  weight, gradient, optimizer state, RNG state or (tracked) module buffer changes, and the
  same step can simply be retried. The update phase runs after the loss check, all stages
  together, with Ctrl-C deferred until it is over.
* An asynchronous step stops at an action boundary. An exception *between* actions (a Ctrl-C,
  which is deferred to the next boundary; a non-finite loss with ``on_nonfinite="raise"``
  after its micro-batch was dropped) leaves the rest of the step's program pending: the next
  ``step()`` or ``flush()`` runs it first, so an interrupted run continues exactly as an
  uninterrupted one. An exception raised *inside* an action (the user's stage or loss
  function, an out-of-memory error) drops that action's micro-batch at every stage, as a
  non-finite loss would be; a backward that failed halfway also drops the gradients its stage
  had accumulated for the current update (partial sums cannot be told apart), and a failed
  update is skipped. The rest of the step's program stays pending as above.

Either way the exception propagates with a note saying where it happened and what the
pipeline did about it, and ``flush()``, ``state_dict()``/``engine.save`` (after the flush)
and further steps work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from engine.runtime import labels
from engine.runtime import trace as _trace
from engine.runtime.clock import Clock
from engine.runtime.device_flags import DeviceFlags
from engine.runtime.failures import FailureHandling, Outcome
from engine.runtime.interrupts import Interrupts
from engine.runtime.program import BB, OP_NAMES, B, F, StepCompiler, StepProgram, U, W
from engine.runtime.result import StepResult, _Input  # StepResult: re-exported
from engine.runtime.rollback import BufferTracker
from engine.runtime.stage import DROPPED, Stage
from engine.runtime.streams import StageStreams
from engine.runtime.sync_step import SynchronousSteps
from engine.schedule.ir import Action, Kind
from engine.schedule.spec import ScheduleSpec

__all__ = ["Executor", "StepResult"]

_KINDS = {F: Kind.FORWARD, B: Kind.BACKWARD, W: Kind.WEIGHT}
_NO_ACTIVE: dict[int, tuple[int, str]] = {}


class Executor(SynchronousSteps, FailureHandling):
    """Execution of one schedule over the stages this process holds (module docstring).

    Args:
        spec: the resolved schedule.
        stages: the Stage objects held here (all of them locally).
        on_nonfinite: "raise", "skip" or "skip_update" (see ``Pipeline.step``).
        device_flags: asynchronous "skip_update": flag non-finite losses on the device
            (:mod:`~engine.runtime.device_flags`) instead of reading each one on the host.
        streams: the per-stage streams (CUDA, or the CPU stand-in).
    """

    def __init__(
        self,
        spec: ScheduleSpec,
        stages: list[Stage],
        *,
        on_nonfinite: str,
        streams: StageStreams,
        device_flags: bool = False,
    ) -> None:
        self.spec = spec
        self.S = spec.stages
        self.M = spec.chunks
        self.sync = spec.synchronous
        self.stages = stages
        self.by_index = {st.index: st for st in stages}
        self.compiler = StepCompiler(spec)
        self.on_nonfinite = on_nonfinite
        self.streams = streams
        #: loss scale of every micro-batch: a full update group sums to the mean loss
        self.scale = 1.0 / (self.M if self.sync else spec.update_size)
        #: asynchronous schedules act on a non-finite loss at once (one host read per
        #: micro-batch) or flag it on the device ("skip_update"); synchronous ones check the
        #: step's losses before its update phase
        self.immediate_nonfinite = not self.sync and not device_flags
        self.flags = DeviceFlags() if device_flags else None
        program = spec.program
        ranks = (
            tuple(program.rank_of(s) for s in range(program.stages))
            if program is not None and program.rank_order is not None
            else None
        )
        self.clock = Clock(self.S, spec.split_backward, ranks, spec.split_only, self.M)
        if program is not None and program.overlaps:  # DualPipeV's F;B pairs
            self.clock.overlap(program.overlaps, program.num_micro_batches)
        #: synchronous steps chain the stages' graphs (one process holds every stage), unless
        #: the schedule splits backwards into B and W: those run per stage, as scheduled
        self.chain_sync = len(stages) == spec.stages and not spec.split_backward
        for st in stages:
            st.split = spec.split_backward
            st.split_only = spec.split_only[st.index] if spec.split_only is not None else None
        self.tracker = BufferTracker([st.module for st in stages])
        self.interrupts = Interrupts()
        #: testing hook, called before every action as hook(stage, kind, micro-batch id);
        #: an exception it raises is an exception "between actions" (engine.testing.faults)
        self.action_hook: Callable[[int, str, int], None] | None = None
        self.n_base = 0  # global id of the segment's micro-batch 0
        self.j = 0  # steps fed in the segment
        self.active = False
        self.dropped = 0
        self.steps = 0
        self.skipped_steps = 0
        self.inputs: dict[int, _Input] = {}
        self.acts: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.grads: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.losses: list[tuple[int, Tensor, int]] = []
        self.tail: tuple[StepProgram, int, int] | None = None
        #: when a list: every F/B/U executed, as (stage, Action with global micro-batch ids)
        self.log: list[tuple[int, Action]] | None = None
        #: when a list (CUDA streams): (stage, kind, micro-batch, start, end) timing events
        #: recorded on the stage's stream around every forward and backward
        self.cuda_events: list[tuple[int, str, int, Any, Any]] | None = None
        #: tied parameters across stages (engine.runtime.ties): their gradients are summed
        #: before a synchronous update phase
        self.ties: Any = None
        #: Pipeline(cuda_graphs="program"): the synchronous loss check on the device, called
        #: with the step's losses instead of reading them (engine.runtime.capture)
        self.device_check: Callable[[list[Tensor]], None] | None = None
        #: gradient clipping (engine.runtime.clipping): the synchronous global norm is taken
        #: before the update phase; asynchronous stages clip their own groups
        self.clipper: Any = None
        #: float16 dynamic loss scaling (engine.runtime.amp), synchronous schedules
        self.loss_scaler: Any = None
        self._pc = 0
        self._in_action = False

    # ------------------------------------------------------------------ segments

    def _open_segment(self) -> None:
        self.active = True
        self.j = 0
        for st in self.stages:
            st.segment_updates = st.updates
            st.forwards = 0

    def _close_segment(self) -> None:
        self.n_base += self.j * self.M
        self.j = 0
        self.active = False
        self.tail = None
        for st in self.stages:
            st.reset_in_flight()
        self.inputs.clear()
        self.acts.clear()
        self.grads.clear()
        self.clock.barrier()

    def in_flight(self) -> int:
        """Micro-batches fed in this segment whose work is not finished (0 when flushed)."""
        if not self.active:
            return 0
        pending = any(st.pending for st in self.stages)
        stashed = max((len(st.stash) for st in self.stages), default=0)
        return max(stashed, 1 if (pending or self.tail is not None) else 0)

    def _feed(self, xs: list[Any], targets: list[Any], samples: list[int], base: int) -> None:
        readers = sum(1 for s in (0, self.S - 1) if s in self.by_index) if self.S > 1 else 1
        self.streams.wait_caller()
        # stage 0 reads the inputs, the last stage the targets (and nobody else either)
        self.streams.from_caller(xs, [0] if 0 in self.by_index else [])
        self.streams.from_caller(targets, [self.S - 1] if self.S - 1 in self.by_index else [])
        for i, (x, t, b) in enumerate(zip(xs, targets, samples, strict=True)):
            self.inputs[base + i] = _Input(x, t, b, readers)

    def _input(self, i: int) -> _Input:
        inp = self.inputs[i]
        inp.readers -= 1
        if inp.readers <= 0:
            del self.inputs[i]
        return inp

    # ------------------------------------------------------------------ the step protocol

    def run_step(self, xs: list[Any], targets: list[Any], samples: list[int]) -> StepResult:
        """One mini-batch (module docstring)."""
        with self.interrupts.deferred(), torch.enable_grad():
            if self.tail is not None:
                self._run_tail()
            if not self.active:
                self._open_segment()
            j = self.j
            prog = self.compiler.step(j)
            base = j * self.M
            first_loss = len(self.losses)
            if self.sync:
                result = self._sync_step(prog, base, xs, targets, samples, first_loss)
            else:
                self._feed(xs, targets, samples, base)
                self.j += 1
                self._run(prog, 0, base)
                result = self._take_losses(first_loss, base, base + self.M)
                if prog.ends_segment:
                    self._close_segment()
            self.steps += 1
            self.interrupts.check()
            return result

    def drain(self) -> Tensor | None:
        """Finish every fed micro-batch and apply every pending gradient (``flush()``)."""
        if self.sync or not self.active:
            return None
        with self.interrupts.deferred(), torch.enable_grad():
            first_loss = len(self.losses)
            if self.tail is not None:
                draining = self.tail[0].kind == "drain"
                self._run_tail()
                if draining:
                    self._close_segment()
            if self.active:
                prog = self.compiler.drain(self.j)
                self._run(prog, 0, self.j * self.M)
                self._close_segment()
            result = self._take_losses(first_loss)
            self.interrupts.check()
            return result.loss

    def _run_tail(self) -> None:
        assert self.tail is not None
        prog, pc, base = self.tail
        self.tail = None
        self._run(prog, pc, base)
        if prog.ends_segment and prog.kind == "step":
            self._close_segment()

    # ------------------------------------------------------------------ running

    def _run(self, prog: StepProgram, start: int, base: int) -> None:
        """Run ``prog.local`` from ``start``; on an exception record the pending tail and
        apply the asynchronous failure semantics (module docstring), then re-raise."""
        try:
            self._loop(prog.local, start, base)
        except BaseException as exc:
            pc = self._pc
            # the tail first: whatever the clean-up below does, the step can go on
            self.tail = (prog, pc + 1 if self._in_action else pc, base)
            if self._in_action:
                self._action_failed(prog.local[pc], base, exc)
            else:
                self._note(exc, prog.local[pc] if pc < len(prog.local) else None, base, Outcome.PAUSED)
            raise
        finally:
            for st in self.stages:
                st.settle()

    def _loop(self, ins: tuple[tuple[int, int, Any], ...], start: int, base: int) -> None:
        by_index = self.by_index
        streams = self.streams
        cuda = streams.separate  # per-stage streams (CUDA, or a recording fake)
        clock = self.clock
        interrupts = self.interrupts
        hook = self.action_hook
        log = self.log
        n_base = self.n_base
        perf = time.perf_counter
        for pc in range(start, len(ins)):
            self._pc = pc
            self._in_action = False
            op, s, rel = ins[pc]
            if interrupts.pending:
                interrupts.check()
            if op == BB:
                if hook is not None:
                    for s2, r2 in rel:
                        hook(s2, "B", n_base + base + r2)
                self._in_action = True
                if log is not None:
                    log.extend((s2, self._action(B, r2, base)) for s2, r2 in rel)
                t0 = perf()
                self._backward_batch(rel, base)
                share = (perf() - t0) / len(rel)
                for s2, r2 in rel:
                    clock.record(s2, B, n_base + base + r2, share)
                continue
            if hook is not None:
                hook(s, OP_NAMES[op], n_base + base + (rel if op != U else rel[-1]))
            st = by_index[s]
            self._in_action = True
            if log is not None:
                log.append((s, self._action(op, rel, base)))
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
                    events = self.cuda_events
                    if events is not None:
                        start = torch.cuda.Event(enable_timing=True)
                        start.record()
                    bad = self._compute(st, op, i)
                    if events is not None:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        events.append((s, OP_NAMES[op], n_base + i, start, end))
            else:
                bad = self._compute(st, op, i)
            clock.record(s, op, n_base + i, perf() - t0)
            if bad:
                self._in_action = False
                self._pc = pc + 1
                raise self._nonfinite_error([n_base + i])
        self._pc = len(ins)
        self._in_action = False

    def _compute(self, st: Stage, op: int, i: int) -> bool:
        """F, B or W of micro-batch i on ``st``; True when a non-finite loss must raise now."""
        if op == F:
            return self._forward(st, i)
        if op == W:
            st.backward_weight(i, self.n_base + i)
            return False
        return self._backward(st, i)

    def _action(self, op: int, rel: Any, base: int) -> Action:
        g = self.n_base + base
        if op == U:
            return Action.update([g + m for m in rel])
        return Action(_KINDS[op], (g + rel,))

    def _forward_inputs(self, st: Stage, i: int) -> tuple[Any, Any, Any, _Input | None]:
        """What F(i) at ``st`` reads: (x, x's ready event, target, the step's input record);
        x is the mini-batch's at stage 0, else the previous stage's output from the mailbox."""
        s = st.index
        inp = self._input(i) if (s == 0 or st.is_last) else None
        if s == 0:
            x, ev = inp.x, None  # type: ignore[union-attr]
        else:
            x, ev = self.acts.pop((s, i))
        target = inp.target if (st.is_last and inp is not None) else None
        return x, ev, target, inp

    def _forward(self, st: Stage, i: int) -> bool:
        """F(i) on ``st``; True when its loss is non-finite and that must raise now."""
        s = st.index
        last = st.is_last
        x, ev, target, inp = self._forward_inputs(st, i)
        if s > 0:
            self.streams.wait(s, ev, x)
        n = self.n_base + i
        out, loss = st.forward(i, n, x, target, self.scale)
        if not last:
            self.acts[(s + 1, i)] = (out, self.streams.record(s) if out is not DROPPED else None)
            return False
        if loss is None or inp is None:
            return False
        self.losses.append((n, loss, inp.samples))
        if self.flags is not None:  # no host read: the flag skips the updates on the device
            self.flags.mark(self.stages, i, loss)
            return False
        if not self.immediate_nonfinite or math.isfinite(loss.item()):
            return False
        self._drop_everywhere(i)
        return self.on_nonfinite == "raise"

    def _backward(self, st: Stage, i: int) -> bool:
        s = st.index
        n = self.n_base + i
        if st.chain:  # the last stage's backward runs every stage's (module docstring)
            if st.is_last:
                labels.ACTIVE = {x: (n, "B") for x in self.by_index}
            try:
                st.backward(i, n, None)
            finally:
                labels.ACTIVE = _NO_ACTIVE
            return False
        if st.is_last:
            grad = None
        else:
            grad, ev = self.grads.pop((s, i))
            self.streams.wait(s, ev, grad)
        gin = st.backward(i, n, grad)
        if s > 0:
            self.grads[(s - 1, i)] = (gin, self.streams.record(s) if gin is not DROPPED else None)
        return False

    def _backward_batch(self, items: tuple[tuple[int, int], ...], base: int) -> None:
        """Several stages' backwards (different stages, independent) in one autograd call;
        while profiling each runs on its own so every one keeps its profiler label."""
        if labels.profiling() or self.streams.separate or _trace.ACTIVE is not None:
            try:
                for s, rel in items:
                    st = self.by_index[s]
                    if self.streams.separate:
                        with self.streams.on(s):
                            self._backward(st, base + rel)
                    else:
                        self._backward(st, base + rel)
            except BaseException:
                self._batch_failed(items, base)  # as the one autograd call below would
                raise
            return
        jobs = []
        upstream: list[tuple[Stage, int, Any]] = []
        n_base = self.n_base
        active = {}
        try:
            for s, rel in items:
                st = self.by_index[s]
                i = base + rel
                grad = None if st.is_last else self.grads.pop((s, i))[0]
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
                self.grads[(st.index - 1, i)] = (gin, None)

    def fold_flags(self) -> None:
        """Add the device-side counts of "skip_update" (non-finite losses, updates skipped)
        to the host counters: one host read (``stats()``)."""
        if self.flags is None:
            return
        self.streams.join()
        bad, skipped = self.flags.fold(self.stages)
        self.dropped += bad
        for st, k in zip(self.stages, skipped, strict=True):
            st.skipped_updates += k

    def _drop_everywhere(self, i: int) -> None:
        """Micro-batch i contributes no gradient at any stage (a non-finite loss)."""
        self.dropped += 1
        for st in self.stages:
            st.drop(i)

    # ------------------------------------------------------------------ losses

    def _take_losses(self, first: int, lo: int | None = None, hi: int | None = None) -> StepResult:
        """Sample-weighted mean loss of the micro-batches computed since ``first`` (those with
        segment ids in [lo, hi) when given); the losses list is emptied."""
        losses = self.losses[first:]
        self.losses = []
        self.streams.join()
        if lo is not None and hi is not None:
            glo, ghi = self.n_base + lo, self.n_base + hi
            losses = [x for x in losses if glo <= x[0] < ghi]
        if not losses:
            return StepResult(None)
        for _, loss, _ in losses:
            self.streams.to_caller(loss)
        total = sum(b for _, _, b in losses)
        if len(losses) == 1:
            value = losses[0][1].float()
        else:
            value = (sum(loss.double() * b for _, loss, b in losses) / total).float()
        bad: list[int] = []
        if self.device_check is not None:
            self.device_check([loss for _, loss, _ in losses])
        # one host read for the step; a non-finite mean means some loss is not finite
        elif not self.immediate_nonfinite and self.flags is None and not math.isfinite(float(value)):
            bad = [n for n, loss, _ in losses if not bool(torch.isfinite(loss).all())]
        return StepResult(value, len(bad), bad)
