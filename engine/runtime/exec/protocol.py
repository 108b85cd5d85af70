"""The step protocol: what one ``step()`` or ``flush()`` is, for one process or one rank.

Why one class: a step has rules that do not depend on where its actions run -- a *segment*
(the micro-batches since the last flush) opens and closes; a synchronous step runs its
actions, checks its losses and then commits every stage's update at once, or rolls back to
the point it started from; a Ctrl-C is deferred to an action boundary; a non-finite loss is
raised, skipped or dropped (``on_nonfinite``); and every exception leaves with a note saying
what the pipeline did about it (an :class:`~engine.runtime.exec.failures.Outcome`). These rules
are written here once. Where the actions run is a *runner*'s business: the merged order of
every stage in one process (:class:`~engine.runtime.exec.executor.MergedOrder`) or one rank's lane
with blocking communication (:class:`~engine.runtime.ranks.rank.RankLane`). This is the one-loop
shape of torch.distributed.pipelining: one protocol, different action lists.

The exception guarantees themselves (docs/ALGORITHMS.md, "Exceptions inside a step"):

* A synchronous step is rolled back, whatever raised where before its update phase: no
  weight, gradient, optimizer state, RNG state or (tracked) module buffer changes, and the
  same step can simply be retried. The update phase runs after the loss check, all stages
  together, with Ctrl-C deferred until it is over.
* An asynchronous step stops at an action boundary. An exception *between* actions (a Ctrl-C,
  which is deferred to the next boundary; a non-finite loss with ``on_nonfinite="raise"``
  after its micro-batch was dropped) leaves the rest of the step's program pending: the next
  ``step()`` or ``flush()`` runs it first, so an interrupted run continues exactly as an
  uninterrupted one. An exception raised *inside* an action drops what the action touched
  (the runner says what: :mod:`~engine.runtime.exec.failures`); the rest stays pending as above.
* Under a multi-process transport a rank cannot stop between two actions alone (its peers
  would wait for messages that never come): a Ctrl-C is deferred to the end of the step,
  which every rank reaches in the same state (the runner's ``stops_between_actions``).

Either way the exception propagates with a note, and ``flush()``, ``state_dict()``/
``engine.save`` (after the flush) and further steps work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from engine.errors import NonFiniteLossError
from engine.runtime.exec.clock import Clock
from engine.runtime.stage.device_flags import DeviceFlags
from engine.runtime.exec.failures import Outcome, add_outcome, nonfinite_message, where
from engine.runtime.exec.interrupts import Interrupts
from engine.runtime.exec.program import B, F, StepCompiler, StepProgram, U, W
from engine.runtime.exec.result import StepResult, _Input
from engine.runtime.exec.rollback import BufferTracker, RollbackPoint
from engine.runtime.stage.stage import Stage
from engine.runtime.exec.streams import StageStreams
from engine.schedule.ir import Action, Kind
from engine.schedule.spec import ScheduleSpec

__all__ = ["StepProtocol", "Runner"]

class Runner(Protocol):
    """Where a step's actions run (module docstring): the protocol calls these, nothing else."""

    #: a Ctrl-C may stop the step at the next action boundary (one process); else it is
    #: deferred to the end of the step (a rank)
    stops_between_actions: bool
    #: the index (in the running program's action list) of the action running or next
    pc: int
    #: whether the last exception came from inside the action at ``pc``
    in_action: bool

    def feed(self, xs: list[Any], targets: list[Any], samples: list[int], base: int) -> None: ...
    def begin(self) -> None: ...
    def prepare_sync(self) -> None: ...
    def run(self, prog: StepProgram, start: int, base: int, updates: bool) -> None: ...
    def action(self, prog: StepProgram, pc: int) -> tuple[int, int, Any] | None: ...
    def failed(self, prog: StepProgram, base: int, exc: BaseException) -> None: ...
    def recoverable(self, exc: BaseException) -> bool: ...
    def share(self, result: StepResult) -> StepResult: ...
    def end_sync(self) -> None: ...
    def end_drain(self) -> None: ...
    def clear(self) -> None: ...
    def reported(self) -> Any: ...
    def take_failure(self) -> BaseException | None: ...


class StepProtocol:
    """The rules of a step (module docstring) over the stages this process holds, and the
    segment's state (fed inputs, mailboxes, losses, counters) that saving in flight reads.

    Args:
        spec: the resolved schedule.
        stages: the Stage objects held here (all of them locally).
        on_nonfinite: "raise", "skip" or "skip_update" (see ``Pipeline.step``).
        streams: the per-stage streams (CUDA, or the CPU stand-in).
        device_flags: asynchronous "skip_update": flag non-finite losses on the device
            (:mod:`~engine.runtime.stage.device_flags`) instead of reading each one on the host.
    """

    runner: Runner

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
        #: tied parameters across stages (engine.runtime.ties.groups): their gradients are summed
        #: before a synchronous update phase
        self.ties: Any = None
        #: Pipeline(cuda_graphs="program"): the synchronous loss check on the device, called
        #: with the step's losses instead of reading them (engine.runtime.capture.synchronous)
        self.device_check: Callable[[list[Tensor]], None] | None = None
        #: gradient clipping (engine.runtime.exec.clipping): the synchronous global norm is taken
        #: before the update phase; asynchronous stages clip their own groups
        self.clipper: Any = None
        #: float16 dynamic loss scaling (engine.runtime.precision), synchronous schedules
        self.loss_scaler: Any = None
        #: the GPU of a rank without stage streams (NCCL), whose RNG a rollback restores
        self.rng_device: torch.device | None = None

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

    def take_input(self, i: int) -> _Input:
        """Micro-batch i's input record, forgotten once its last reader took it."""
        inp = self.inputs[i]
        inp.readers -= 1
        if inp.readers <= 0:
            del self.inputs[i]
        return inp

    def action_of(self, op: int, rel: Any, base: int) -> Action:
        """An action of the running program with global micro-batch ids (the log)."""
        g = self.n_base + base
        if op == U:
            return Action.update([g + m for m in rel])
        return Action({F: Kind.FORWARD, B: Kind.BACKWARD, W: Kind.WEIGHT}[op], (g + rel,))

    # ------------------------------------------------------------------ Ctrl-C

    @contextmanager
    def _deferral(self) -> Iterator[None]:
        """Run a step or flush with Ctrl-C deferred (:mod:`~engine.runtime.exec.interrupts`): the
        runner checks the flag between actions when it may stop there; one still pending at
        the end is raised after the completed step, saying so."""
        with self.interrupts.deferred(), torch.enable_grad():
            yield
        try:
            self.interrupts.check()  # (a captured step checks after its window instead)
        except KeyboardInterrupt as exc:
            self.note_outcome(exc, None, 0, Outcome.COMPLETED_THEN_INTERRUPTED)
            raise

    # ------------------------------------------------------------------ the step

    def run_step(self, xs: list[Any], targets: list[Any], samples: list[int]) -> StepResult:
        """One mini-batch (module docstring)."""
        with self._deferral():
            if self.tail is not None:
                self._run_tail()
            if not self.active:
                self._open_segment()
            prog = self.compiler.step(self.j)
            base = self.j * self.M
            first_loss = len(self.losses)
            self.runner.begin()
            if self.sync:
                result = self._sync_step(prog, base, xs, targets, samples, first_loss)
            else:
                result = self._async_step(prog, base, xs, targets, samples, first_loss)
            self.steps += 1
            return result

    def drain(self) -> Tensor | None:
        """Finish every fed micro-batch and apply every pending gradient (``flush()``)."""
        if self.sync or not self.active:
            return None
        with self.runner.reported(), self._deferral():
            first_loss = len(self.losses)
            if self.tail is not None:
                draining = self.tail[0].kind == "drain"
                self._run_tail()
                if draining:
                    self._close_segment()
            if self.active:
                prog = self.compiler.drain(self.j)
                self._run(prog, 0, self.j * self.M)
                try:
                    self.runner.end_drain()
                finally:
                    self._close_segment()
            loss = self._take_losses(first_loss).loss
            late = self.runner.take_failure()
            if late is not None:  # a rank dropped what it touched and finished the flush
                raise late
            return loss

    def _run_tail(self) -> None:
        assert self.tail is not None
        prog, pc, base = self.tail
        self.tail = None
        self._run(prog, pc, base)
        if prog.ends_segment and prog.kind == "step":
            self._close_segment()

    # ------------------------------------------------------------------ asynchronous steps

    def _async_step(
        self, prog: StepProgram, base: int, xs: list[Any], targets: list[Any], samples: list[int],
        first_loss: int,
    ) -> StepResult:
        self.runner.feed(xs, targets, samples, base)
        self.j += 1
        self._run(prog, 0, base)
        result = self.runner.share(self._take_losses(first_loss, base, base + self.M))
        if prog.ends_segment:
            self._close_segment()
        # a rank that dropped what a failing action touched went on to the step's end (noted)
        late = self.runner.take_failure()
        if late is not None or result.nonfinite:  # (counted: the step ran to its end)
            self.steps += 1
            raise late or self.nonfinite_error(result.bad, result.nonfinite)
        return result

    def _run(self, prog: StepProgram, start: int, base: int) -> None:
        """Run ``prog`` from ``start``; on an exception record the pending tail and apply the
        asynchronous failure semantics (module docstring), then re-raise."""
        runner = self.runner
        try:
            runner.run(prog, start, base, updates=True)
        except BaseException as exc:
            pc, inside = runner.pc, runner.in_action
            if runner.stops_between_actions:
                # the tail first: whatever the clean-up below does, the step can go on
                self.tail = (prog, pc + 1 if inside else pc, base)
            if inside:  # the runner drops what the action touched, and says so
                runner.failed(prog, base, exc)
            elif runner.stops_between_actions:
                self.note_outcome(exc, runner.action(prog, pc), base, Outcome.PAUSED)
            raise
        finally:
            for st in self.stages:
                st.settle()

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

    def drop_everywhere(self, i: int) -> None:
        """Micro-batch i contributes no gradient at any stage (a non-finite loss)."""
        self.dropped += 1
        for st in self.stages:
            st.drop(i)

    # ------------------------------------------------------------------ synchronous steps

    def _cuda_devices(self) -> list[int]:
        """The GPUs whose RNG state a synchronous step's rollback point keeps: the stage
        streams' device, or the rank's GPU (one stage per rank under NCCL runs on the
        caller's stream, with no stage streams)."""
        # a captured step reads no RNG state inside its window (engine.runtime.capture.synchronous)
        if self.device_check is not None:
            return []
        dev = self.streams.device if self.streams.cuda else self.rng_device
        if dev is None or dev.type != "cuda":
            return []
        return [dev.index if dev.index is not None else torch.cuda.current_device()]

    def _sync_step(
        self, prog: StepProgram, base: int, xs: list[Any], targets: list[Any], samples: list[int],
        first_loss: int,
    ) -> StepResult:
        """A synchronous step: run, check the losses, then update every stage at once -- or
        roll back to the point it started from. The window a captured step records
        (:mod:`~engine.runtime.capture.synchronous`)."""
        point = RollbackPoint(self.tracker, self._cuda_devices())
        runner = self.runner
        runner.prepare_sync()
        try:
            runner.feed(xs, targets, samples, base)
            runner.run(prog, 0, base, updates=False)
            runner.end_sync()
            result = runner.share(self._take_losses(first_loss, base, base + self.M))
            skip = self._check_losses(result)
            if not skip:
                self._commit_hooks(prog, base)
        except BaseException as exc:
            self._rollback(point)
            if runner.recoverable(exc):
                self.note_outcome(exc, runner.action(prog, runner.pc), base, Outcome.ROLLED_BACK)
            elif runner.in_action:
                self.note_outcome(exc, runner.action(prog, runner.pc), base, Outcome.RANK_STOPPED)
            raise
        finally:
            for st in self.stages:
                st.settle()
        failed: BaseException | None = None
        if skip:
            for st in self.stages:
                st.forget_pending()
            self.skipped_steps += 1
        else:
            try:
                self._commit(prog, base)
            except BaseException as exc:  # (noted) every other stage updated: the step happened
                failed = exc
        point.commit()
        self.j += 1
        if prog.ends_segment:
            self._close_segment()
        else:
            for st in self.stages:
                st.reset_in_flight()
        self.clock.barrier()
        if failed is not None:
            self.steps += 1  # counted: the other stages updated
            raise failed
        return result

    def _check_losses(self, result: StepResult) -> bool:
        """The hook before a synchronous update: True to skip the step (non-finite losses
        with on_nonfinite="skip"); raises NonFiniteLossError with "raise"."""
        if result.nonfinite == 0:
            return False
        self.dropped += result.nonfinite
        if self.on_nonfinite == "raise":
            raise self.nonfinite_error(result.bad, result.nonfinite)
        return True

    def _commit_hooks(self, prog: StepProgram, base: int) -> None:
        """Everything that may refuse the update phase runs before any stage updates."""
        hook = self.action_hook
        if hook is None:
            return
        for s, mbs in prog.commit:
            if s in self.by_index:
                self.runner.pc = len(prog.local)
                hook(s, "U", self.n_base + base + mbs[-1])

    def _commit(self, prog: StepProgram, base: int | None = None) -> None:
        """The update phase of a synchronous step: every stage held here (under gloo/NCCL a
        rank's own), Ctrl-C deferred till the end. An optimizer that raises skips its own
        stage's update; the others still update, and the first error is raised afterwards
        (nothing is left half-applied). ``base``: the step's first micro-batch (default: step j's)."""
        first: BaseException | None = None
        base = self.j * self.M if base is None else base
        commit = [(s, mbs) for s, mbs in prog.commit if s in self.by_index]
        self._before_updates([self.by_index[s] for s, _ in commit])
        for s, mbs in commit:
            st = self.by_index[s]
            if self.log is not None:
                self.log.append((s, self.action_of(U, mbs, base)))
            try:
                with self.streams.on(s):
                    st.update()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other stages
                with self.streams.on(s):
                    st.forget_pending()  # its gradients are discarded, as the note says
                if first is None:
                    first = exc
                    self.note_outcome(exc, (U, s, mbs), base, Outcome.UPDATE_PHASE_FAILED)
        if first is not None:
            raise first

    def _before_updates(self, stages: list[Stage]) -> None:
        """What a synchronous update phase needs from all its stages before any steps: tied
        gradients summed; with clipping, every gradient final (renormalised, the
        data-parallel mean) and the global norm taken (one reduction over the ranks); with
        float16 loss scaling, unscaled and the step's one found_inf decided first."""
        if self.ties is not None:
            self.ties.reduce()
        scaler = self.loss_scaler
        if self.clipper is None and scaler is None:
            return
        # on the caller's stream, after every stage stream's backwards; the stage streams'
        # updates start after it (CUDA stage streams; nothing to do on the CPU)
        self.streams.join()
        for st in stages:
            st.prepare_grads()
        if scaler is not None:  # unscaled first (GradScaler.unscale_), then clipped
            scaler.unscale(stages)
        if self.clipper is not None:  # its all-reduce carries found_inf along
            self.clipper.begin_step(stages, None if scaler is None else scaler.found_inf)
        elif scaler is not None:
            scaler.reduce()
        if scaler is not None:
            scaler.update()  # the next step's scale; this step's found_inf stays for the updates
        self.streams.wait_caller()

    def _rollback(self, point: RollbackPoint) -> None:
        """Back to the step's rollback point: gradients and stashed activations dropped, the
        step's inputs and messages forgotten, the RNG states and buffers restored."""
        self.streams.join()
        for st in self.stages:
            st.forget_pending()
            st.reset_in_flight()
        self.inputs.clear()
        self.acts.clear()
        self.grads.clear()
        self.losses = []
        self.runner.clear()
        point.restore(stacklevel=4)

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
        last = self.stages[-1].index  # (stage streams: one process holds every stage)
        for _, loss, _ in losses:
            self.streams.to_caller(loss, last)
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

    # ------------------------------------------------------------------ notes

    def note_outcome(self, exc: BaseException, action: Any, base: int, what: Outcome) -> None:
        """Say where ``exc`` happened (``action`` of the program running from ``base``, None:
        at the end of the step) and what the pipeline did about it (``what``)."""
        add_outcome(exc, where(action, self.n_base + base, self.by_index), what)

    def nonfinite_error(self, bad: list[int], count: int | None = None) -> NonFiniteLossError:
        """The non-finite policy's error: ``bad`` micro-batch ids when this process saw them,
        else ``count`` of them (a rank told by the last stage)."""
        if bad:
            which = f"micro-batch {bad[0]}" if len(bad) == 1 else f"micro-batches {', '.join(map(str, bad))}"
        else:
            which = f"{count} micro-batch(es) of this step (seen by the last stage)"
        if self.sync:
            every = "" if self.runner.stops_between_actions else " on every rank"
            what = f"the step was rolled back{every}: no weight or optimizer state changed."
        elif self.runner.stops_between_actions:
            what = (
                "it was dropped at every stage (zero gradient); earlier updates stand, and the "
                "rest of the step runs at the next step() or flush()."
            )
        else:
            what = (
                f"an asynchronous {self.spec.describe()} pipeline under a multi-process "
                "transport could not drop them (that needs every stage in one process): their "
                "gradients already entered updates. Reload the last checkpoint and lower the "
                "learning rate; on_nonfinite='skip_update' (engine.optim optimizers) skips "
                "such updates instead."
            )
        return NonFiniteLossError(nonfinite_message(which, what))
