"""A synchronous step: run, check the losses, then update every stage at once -- or roll back.

Why a module: a synchronous step's promise is all-or-nothing. Before its update phase,
whatever raises -- a Ctrl-C, a stage's forward, a bad target, the non-finite loss check --
rolls the step back: gradients are zeroed, nothing in flight is kept, and the RNG states and
module buffers are restored (:mod:`engine.runtime.rollback`), so the step can be retried as if
it never happened. The update phase runs every stage's update together after the loss
check, with Ctrl-C deferred until it is over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.runtime import labels
from engine.runtime import trace as _trace
from engine.runtime.failures import Outcome
from engine.runtime.program import StepProgram, U
from engine.runtime.rollback import BufferTracker, RollbackPoint

if TYPE_CHECKING:
    from engine.runtime.result import StepResult
    from engine.runtime.stage import Stage
    from engine.runtime.streams import StageStreams

__all__ = ["SynchronousSteps"]


class SynchronousSteps:
    """Mixin of :class:`~engine.runtime.executor.Executor` (uses its loop and stages)."""

    stages: list[Stage]
    by_index: dict[int, Stage]
    streams: StageStreams
    tracker: BufferTracker
    chain_sync: bool
    n_base: int
    j: int
    M: int
    log: Any
    action_hook: Any
    on_nonfinite: str
    dropped: int
    skipped_steps: int
    steps: int
    ties: Any
    clipper: Any
    loss_scaler: Any

    # ------------------------------------------------------------------ synchronous steps

    def _cuda_devices(self) -> list[int]:
        # a captured step reads no RNG state inside its window (engine.runtime.capture)
        if not self.streams.cuda or getattr(self, "device_check", None) is not None:
            return []
        dev = self.streams.device
        return [dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()]

    def _sync_step(
        self,
        prog: StepProgram,
        base: int,
        xs: list[Any],
        targets: list[Any],
        samples: list[int],
        first_loss: int,
    ) -> StepResult:
        point = RollbackPoint(self.tracker, self._cuda_devices())
        # one autograd call per micro-batch through every stage (no update happens inside a
        # synchronous step, so chaining the stages' graphs computes exactly what per-stage
        # backwards compute); while profiling or tracing, per-stage backwards keep their labels
        chain = self.chain_sync and not labels.profiling() and _trace.ACTIVE is None
        for st in self.stages:
            st.chain = chain
            # a chained backward runs through every stage: all take fresh gradients
            st.store.fresh.peers = tuple(x.store.fresh for x in self.stages if x is not st) if chain else ()
        try:
            self._feed(xs, targets, samples, base)
            self._loop(prog.local, 0, base)
            result = self._take_losses(first_loss, base, base + self.M)
            skip = self._check_losses(result)
            if not skip:
                self._commit_hooks(prog, base)
        except BaseException as exc:
            at = prog.local[self._pc] if self._pc < len(prog.local) else None
            self._rollback(point)
            self._note(exc, at, base, Outcome.ROLLED_BACK)
            raise
        failed: BaseException | None = None
        if skip:
            for st in self.stages:
                st.forget_pending()
            self.skipped_steps += 1
        else:
            try:
                self._commit(prog)
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
            self.steps += 1  # counted, as under gloo/NCCL (run_step counts the others)
            raise failed
        return result

    def _check_losses(self, result: StepResult) -> bool:
        """The hook before a synchronous update: True to skip the step (non-finite losses
        with on_nonfinite="skip"); raises NonFiniteLossError with "raise"."""
        if result.nonfinite == 0:
            return False
        self.dropped += result.nonfinite
        if self.on_nonfinite == "raise":
            raise self._nonfinite_error(result.bad)
        return True

    def _commit_hooks(self, prog: StepProgram, base: int) -> None:
        """Everything that may refuse the update phase runs before any stage updates."""
        hook = self.action_hook
        if hook is None:
            return
        for s, mbs in prog.commit:
            self._pc = len(prog.local)
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
                self.log.append((s, self._action(U, mbs, base)))
            try:
                with self.streams.on(s):
                    st.update()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other stages
                with self.streams.on(s):
                    st.forget_pending()  # its gradients are discarded, as the note says
                if first is None:
                    first = exc
                    self._note(exc, (U, s, mbs), base, Outcome.UPDATE_PHASE_FAILED)
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
        self.streams.join()
        for st in self.stages:
            st.forget_pending()
            st.reset_in_flight()
        self.inputs.clear()
        self.acts.clear()
        self.grads.clear()
        self.losses = []
        point.restore(stacklevel=4)
