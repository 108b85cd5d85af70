"""``engine.Pipeline``: train a model split into stages with any schedule of ALGORITHMS.md.

This is the user-facing object. It validates the configuration (every invalid combination
fails here, before any weight exists in a pipeline), builds one Stage per module with its own
optimizer, derives each stage's delay D_s by simulating the schedule and writes it into the
optimizer's param groups, and drives the Executor. With ``transport="local"`` every stage runs
in this process, and that run is the exact simulator of each method's staleness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine.runtime.errors import NotFlushedError, PipelineConfigError, PipelineInputError
from engine.runtime.executor import Executor
from engine.runtime.plan import SCHEDULES, SYNC_SCHEDULES, derive_delays
from engine.runtime.policy import make_policy
from engine.runtime.stage import Stage

__all__ = ["Pipeline", "CHECKPOINT_MODES", "PREDICTIONS"]

CHECKPOINT_MODES = ("never", "except_last", "always")
PREDICTIONS = ("lwp", "spectrain", "spectrain_reuse")
TRANSPORTS = ("local",)


def _describe(module: nn.Module) -> str:
    return type(module).__name__


def _first_layer_expectation(module: nn.Module) -> str:
    """' (its first layer Linear expects in_features=8)' when the first leaf says so."""
    for name, sub in module.named_modules():
        for attr in (
            "in_features",
            "in_channels",
            "num_features",
            "normalized_shape",
            "embedding_dim",
        ):
            if hasattr(sub, attr) and not list(sub.children()):
                return f" (its first layer {name or type(sub).__name__} ({type(sub).__name__}) expects {attr}={getattr(sub, attr)})"
    return ""


def _split_sequential(seq: nn.Sequential, balance: Sequence[int]) -> list[nn.Module]:
    layers = list(seq.children())
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in balance):
        raise PipelineConfigError(
            f"balance={list(balance)!r} must be a list of layer counts (ints)"
        )
    if len(balance) > len(layers):
        raise PipelineConfigError(
            f"balance asks for {len(balance)} stages but the nn.Sequential has only {len(layers)} layers; "
            f"use at most {len(layers)} stages (each stage needs at least one layer)"
        )
    if any(b < 1 for b in balance):
        raise PipelineConfigError(
            f"balance={list(balance)} has a stage with no layers; every entry must be >= 1"
        )
    if sum(balance) != len(layers):
        raise PipelineConfigError(
            f"balance={list(balance)} covers {sum(balance)} layers but the nn.Sequential has {len(layers)}; "
            "the counts must add up to the number of layers"
        )
    out: list[nn.Module] = []
    start = 0
    for b in balance:
        out.append(nn.Sequential(*layers[start : start + b]))
        start += b
    return out


class Pipeline:
    """A model split into S stages trained with a pipeline schedule.

    Args:
        stages: list of ``nn.Module`` (stage 0 first), or an ``nn.Sequential`` with ``balance``.
        schedule: "naive", "gpipe", "1f1b" (synchronous: gradients equal an unpipelined
            model's), "pipedream" (weight stashing), "2bw" (double buffering) or "pb"
            (pipelined backprop with live weights; add ``prediction`` or an optimizer with
            ``discrepancy_correction`` for the mitigations).
        chunks: M, micro-batches per mini-batch (per ``step()``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the *mean* over the micro-batch's samples.
        optimizer: ``params -> optimizer``, called once per stage with that stage's parameters.
            The pipeline writes each stage's delay D_s into ``group["delay"]``.
        checkpoint: activation recomputation: "never", "except_last" (all but the last stage)
            or "always".
        transport: only "local" (every stage in this process).
        update_size: k, micro-batches per optimizer step. Sync schedules and 2bw: M (default);
            pipedream and pb: default 1.
        order: for "pb": "dataflow" (default; Kosson et al.'s ticks) or "1f1b".
        balance: layer counts per stage when ``stages`` is an ``nn.Sequential``, or "time" /
            "memory" to partition automatically (engine.partition; then also ``num_stages``,
            ``sample`` = one micro-batch of inputs, optional ``memory_cap_bytes``).
        prediction: for "pb": "lwp" (F reads the optimizer's prediction with horizon D_s),
            "spectrain" or "spectrain_reuse". Default: "lwp" when the stage optimizer has its
            ``prediction`` option set.
        discrepancy_correction: for "pb": PipeMare T2 (B reads w - tau_s * delta). Default: on
            when the stage optimizer has ``discrepancy_correction=True``; ``True`` with a plain
            torch optimizer makes the runtime track delta (decay ``correction_decay``).
        lr_scheduler: ``optimizer -> LRScheduler`` per stage (e.g. ``lambda o: PipeMareLR(o, 100)``),
            created after delays are set, stepped after every update.
        on_nonfinite: "raise" or "skip" a non-finite loss (see ``step``).
        trace: keep per-micro-batch records (t_F, t_B, update) in ``stage.records``.
        weights: where weights and their versions live: "arena" (the C++ WeightArena),
            "torch" (plain tensors) or "auto" (the arena when the extension is built).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module] | nn.Sequential,
        *,
        schedule: str,
        chunks: int,
        loss_fn: Callable[[Tensor, Any], Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        checkpoint: str = "except_last",
        transport: str = "local",
        update_size: int | None = None,
        order: str | None = None,
        balance: Sequence[int] | str | None = None,
        prediction: str | None = None,
        discrepancy_correction: bool | None = None,
        correction_decay: float = 0.1,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        on_nonfinite: str = "raise",
        trace: bool = False,
        weights: str = "auto",
        num_stages: int | None = None,
        sample: Tensor | None = None,
        memory_cap_bytes: float | None = None,
    ) -> None:
        if isinstance(balance, str):
            balance = self._auto_balance(
                stages, balance, schedule, chunks, order, num_stages, sample, memory_cap_bytes
            )
        modules = self._resolve_stages(stages, balance)
        S = len(modules)
        if schedule not in SCHEDULES:
            raise PipelineConfigError(
                f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        if transport not in TRANSPORTS:
            raise PipelineConfigError(
                f"transport={transport!r} is not available in this runtime; use transport='local' "
                "(one process, exact simulation of every schedule)"
            )
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise PipelineConfigError(
                f"chunks={chunks!r} must be an int >= 1 (micro-batches per mini-batch)"
            )
        if checkpoint not in CHECKPOINT_MODES:
            raise PipelineConfigError(
                f"checkpoint={checkpoint!r}; choose one of {', '.join(CHECKPOINT_MODES)}"
            )
        if weights not in ("auto", "arena", "torch"):
            raise PipelineConfigError(f"weights={weights!r}; choose 'auto', 'arena' or 'torch'")
        if on_nonfinite not in ("raise", "skip"):
            raise PipelineConfigError(f"on_nonfinite={on_nonfinite!r}; choose 'raise' or 'skip'")
        if not callable(loss_fn):
            raise PipelineConfigError(
                "loss_fn must be callable: loss_fn(output, target) -> mean loss"
            )
        if not callable(optimizer):
            raise PipelineConfigError(
                "optimizer must be a factory params -> optimizer, e.g. lambda p: engine.optim.SGD(p, lr=0.1), "
                "so that every stage gets its own instance"
            )
        M = chunks
        if order is not None and (schedule != "pb" or order not in ("dataflow", "1f1b")):
            raise PipelineConfigError(
                f"order={order!r} is only meaningful for schedule='pb' and must be 'dataflow' or '1f1b'"
            )
        if order == "dataflow":
            order = None
        k = self._resolve_update_size(schedule, update_size, M, S)

        self.schedule = schedule
        self.S = S
        self.M = M
        self.k = k
        self.order = order
        self.checkpoint = checkpoint
        self.on_nonfinite = on_nonfinite
        self.transport = transport
        self.weights = weights
        self.steps = 0
        self.skipped_steps = 0
        self._validated: set[tuple[Any, ...]] = set()

        # Stages first, with a provisional policy: the real one depends on the optimizers'
        # options (prediction, discrepancy_correction), which exist only once they are built.
        # Parameter values are untouched by this (they only move into flat buffers).
        stage_objs: list[Stage] = []
        seen: set[int] = set()
        for s, m in enumerate(modules):
            for p in m.parameters():
                if id(p) in seen:
                    raise PipelineConfigError(
                        f"stage {s} shares a parameter with an earlier stage; stages must own disjoint parameters"
                    )
                seen.add(id(p))
            recompute = checkpoint == "always" or (checkpoint == "except_last" and s < S - 1)
            stage_objs.append(
                Stage(
                    s,
                    S,
                    m,
                    optimizer,
                    make_policy("naive", M, S, None, "linear", False),
                    recompute,
                    loss_fn if s == S - 1 else None,
                    trace,
                    weights,
                )
            )
        self.stages = stage_objs

        # mitigations: from the optimizers' options and the pipeline's
        bridge0 = stage_objs[0].bridge
        opt_prediction = None
        opt_correction = False
        for st in stage_objs:
            try:
                pmode = st.bridge.group_option("prediction")
                corr = st.bridge.group_option("discrepancy_correction")
            except ValueError as exc:
                raise PipelineConfigError(f"stage {st.index}: {exc}") from None
            opt_prediction = opt_prediction or pmode
            opt_correction = opt_correction or bool(corr)
        if prediction is not None and prediction not in PREDICTIONS:
            raise PipelineConfigError(
                f"prediction={prediction!r}; choose None or one of {', '.join(PREDICTIONS)}"
            )
        if prediction is None and opt_prediction is not None and schedule == "pb":
            prediction = "lwp"
        if (prediction is not None or opt_prediction is not None) and schedule != "pb":
            raise PipelineConfigError(
                f"weight prediction (LWP/SpecTrain) mitigates the live-weight staleness of schedule='pb'; "
                f"schedule={schedule!r} "
                + ("has no delay" if schedule in SYNC_SCHEDULES else "already uses stashed weights")
                + ". Use schedule='pb' or drop the prediction option (pipeline and optimizer)."
            )
        if prediction is not None and bridge0.is_engine and opt_prediction is None:
            raise PipelineConfigError(
                f"prediction={prediction!r} needs the stage optimizer to predict: build it with "
                "prediction='linear' (or 'momentum'), e.g. engine.optim.SGD(p, lr, momentum=0.9, prediction='linear')"
            )
        correction = (
            opt_correction if discrepancy_correction is None else bool(discrepancy_correction)
        )
        if correction and schedule != "pb":
            raise PipelineConfigError(
                f"discrepancy_correction (PipeMare T2) corrects the live weights of schedule='pb'; "
                f"it is invalid with schedule={schedule!r}"
            )
        if correction and prediction is not None:
            raise PipelineConfigError(
                "combine at most one backward-weight mitigation: discrepancy_correction (PipeMare T2) and "
                f"prediction={prediction!r} both redefine the weights B reads"
            )
        if correction and not opt_correction:
            if bridge0.is_engine:
                raise PipelineConfigError(
                    "discrepancy_correction=True: build the engine optimizer with discrepancy_correction=True "
                    "(it keeps PipeMare's delta)"
                )
            for st in stage_objs:
                st.bridge.enable_fallback_correction(correction_decay)
        self.prediction = prediction
        self.discrepancy_correction = correction
        mode = opt_prediction or "linear"
        policy = make_policy(schedule, M, S, prediction, mode, correction)
        for st in stage_objs:
            st.policy = policy

        # delays by simulation of the schedule (never typed in)
        fv = None
        if schedule == "2bw":
            fv = lambda s, i, u: max(i // M - 1, 0)  # noqa: E731
        self.delays, self._steady_delays = derive_delays(schedule, S, M, k, order, fv)
        for st, d in zip(stage_objs, self.delays, strict=False):
            st.bridge.set_delay(d)
            if lr_scheduler is not None:
                st.scheduler = lr_scheduler(st.optimizer)
        self._executor = Executor(stage_objs, schedule, M, k, order, on_nonfinite)

    # ------------------------------------------------------------------ config helpers

    @staticmethod
    def _auto_balance(
        stages: Any,
        balance: str,
        schedule: str,
        chunks: int,
        order: str | None,
        num_stages: int | None,
        sample: Tensor | None,
        cap: float | None,
    ) -> list[int]:
        """balance="time" | "memory": profile the layers on ``sample`` and split optimally
        (engine.partition), for this schedule's weight versions and activation counts."""
        if not isinstance(stages, nn.Sequential):
            raise PipelineConfigError(f"balance={balance!r} needs `stages` to be an nn.Sequential")
        if num_stages is None or sample is None:
            raise PipelineConfigError(
                f"balance={balance!r} profiles the model: also pass num_stages=S and sample=<one micro-batch "
                "of inputs>, e.g. Pipeline(seq, balance='time', num_stages=4, sample=x[:8], ...)"
            )
        try:
            from engine.partition import balance_model
        except ImportError:
            raise PipelineConfigError(
                f"balance={balance!r} needs engine.partition, which is not importable; pass layer counts"
            ) from None
        try:
            return balance_model(
                stages,
                sample,
                num_stages,
                balance=balance,
                schedule=schedule,
                chunks=chunks,
                memory_cap_bytes=cap,
                order=order,
            )
        except (ValueError, TypeError) as exc:
            raise PipelineConfigError(f"automatic balance={balance!r} failed: {exc}") from exc

    @staticmethod
    def _resolve_stages(stages: Any, balance: Any) -> list[nn.Module]:
        if isinstance(stages, nn.Sequential) and balance is not None:
            return _split_sequential(stages, balance)
        if balance is not None:
            raise PipelineConfigError("balance is only used with an nn.Sequential `stages`")
        if isinstance(stages, nn.Module):
            raise PipelineConfigError(
                "stages must be a list of nn.Module (one per stage), or an nn.Sequential with balance=[...]"
            )
        modules = list(stages)
        if not modules:
            raise PipelineConfigError("stages is empty; pass at least one nn.Module")
        for s, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise PipelineConfigError(f"stage {s} is a {type(m).__name__}, not an nn.Module")
            if isinstance(m, nn.Sequential) and len(m) == 0:
                raise PipelineConfigError(
                    f"stage {s} is an empty nn.Sequential: more stages than layers; use fewer stages"
                )
        return modules

    @staticmethod
    def _resolve_update_size(schedule: str, update_size: int | None, M: int, S: int) -> int:
        if update_size is not None and (
            not isinstance(update_size, int) or isinstance(update_size, bool) or update_size < 1
        ):
            raise PipelineConfigError(f"update_size={update_size!r} must be an int >= 1")
        if schedule in SYNC_SCHEDULES or schedule == "2bw":
            if update_size not in (None, M):
                raise PipelineConfigError(
                    f"schedule={schedule!r} updates once per mini-batch, so update_size must equal chunks={M} "
                    f"(got {update_size}); change chunks instead"
                )
            if schedule == "2bw" and M < S:
                raise PipelineConfigError(
                    f"schedule='2bw' needs chunks >= stages (M >= S) so that two weight versions suffice; "
                    f"got chunks={M} with {S} stages: use chunks >= {S}"
                )
            return M
        return 1 if update_size is None else update_size

    # ------------------------------------------------------------------ input helpers

    def _split(self, inputs: Tensor, targets: Any) -> tuple[list[Tensor], list[Any], list[int]]:
        if not isinstance(inputs, Tensor):
            raise PipelineInputError(
                f"inputs must be a tensor with the batch on dim 0, got {type(inputs).__name__}"
            )
        if inputs.dim() == 0:
            raise PipelineInputError("inputs is a scalar; it needs a batch dimension (dim 0)")
        B = int(inputs.shape[0])
        if isinstance(targets, Tensor) and (targets.dim() == 0 or int(targets.shape[0]) != B):
            raise PipelineInputError(
                f"targets have shape {tuple(targets.shape)} but inputs have {B} samples; dim 0 must match"
            )
        if B % self.M != 0:
            divisors = [d for d in range(1, B + 1) if B % d == 0]
            raise PipelineInputError(
                f"a batch of {B} samples cannot be split into chunks={self.M} equal micro-batches; use a batch "
                f"size divisible by {self.M} (e.g. {max(self.M, B - B % self.M)} or {B + self.M - B % self.M}), or "
                f"chunks in {divisors}"
            )
        b = B // self.M
        xs = list(inputs.split(b))
        ts = list(targets.split(b)) if isinstance(targets, Tensor) else [targets] * self.M
        return xs, ts, [b] * self.M

    def _validate_shapes(self, x: Tensor, target: Any) -> None:
        """One micro-batch through every stage in eval mode without grad (nothing changes: no
        buffers move, no weights) so that shape mismatches are reported before anything runs,
        naming both stages and shapes."""
        key = (
            tuple(x.shape[1:]),
            x.dtype,
            tuple(target.shape[1:]) if isinstance(target, Tensor) else None,
        )
        if key in self._validated:
            return
        modes = [st.module.training for st in self.stages]
        rng = torch.get_rng_state()
        try:
            for st in self.stages:
                st.module.eval()
            h = x
            with torch.no_grad():
                for st in self.stages:
                    try:
                        out = st.module(h)
                    except Exception as exc:  # any failure here is a wiring error; teach the fix
                        if st.index == 0:
                            raise PipelineInputError(
                                f"stage 0 ({_describe(st.module)}) cannot run on an input micro-batch of shape "
                                f"{tuple(h.shape)}{_first_layer_expectation(st.module)}: {exc}"
                            ) from exc
                        raise PipelineInputError(
                            f"stage {st.index - 1} outputs shape {tuple(h.shape)} but stage {st.index} "
                            f"({_describe(st.module)}) cannot take it as input{_first_layer_expectation(st.module)}: "
                            f"{exc}. Make stage {st.index - 1}'s output match stage {st.index}'s input "
                            "(layer sizes or balance)."
                        ) from exc
                    if not isinstance(out, Tensor):
                        raise PipelineInputError(
                            f"stage {st.index} returned {type(out).__name__}; each stage must return one tensor"
                        )
                    h = out
                try:
                    loss = self.stages[-1].loss_fn(h, target)
                except Exception as exc:
                    raise PipelineInputError(
                        f"loss_fn cannot compare the last stage's output of shape {tuple(h.shape)} with targets "
                        f"{tuple(target.shape) if isinstance(target, Tensor) else target!r}: {exc}"
                    ) from exc
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise PipelineInputError(
                        "loss_fn must return a scalar tensor (the mean over the micro-batch's samples), got "
                        f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}"
                    )
        finally:
            for st, m in zip(self.stages, modes, strict=False):
                st.module.train(m)
            torch.set_rng_state(rng)
        self._validated.add(key)

    # ------------------------------------------------------------------ running

    @property
    def is_sync(self) -> bool:
        return self.schedule in SYNC_SCHEDULES

    def step(self, inputs: Tensor, targets: Any) -> Tensor:
        """Run one mini-batch of ``chunks`` micro-batches; return its mean loss (over samples).

        Synchronous schedules update every stage once at the end; the gradient equals an
        unpipelined model's with a mean-reduced loss. Asynchronous schedules keep the pipeline
        full across calls: every forward of this mini-batch completes within the call (so the
        returned loss is this mini-batch's), but backwards and updates of the last micro-batches
        run in later calls or at ``flush()``.

        A non-finite loss with ``on_nonfinite="raise"``: synchronous schedules roll the step
        back (no weight, gradient or optimizer state changes) and raise NonFiniteLossError;
        asynchronous ones drop that micro-batch at every stage (zero gradient) and raise after
        everything before it is consistent. With ``"skip"`` a synchronous step applies no
        update at any stage (counted in ``stats()["skipped_steps"]``); an asynchronous
        micro-batch is dropped at every stage and the rest of its update group is renormalised.
        """
        xs, ts, sizes = self._split(inputs, targets)
        self._validate_shapes(xs[0], ts[0])
        ex = self._executor
        if self.is_sync:
            B = sum(sizes)
            scales = [b / B for b in sizes]
            ex.open_segment()
            ex.draining = True
            ex.N = self.M
            ex.feed(xs, ts, scales)
            try:
                ex.run()
            except BaseException:
                ex.abort()
                raise
            skip = bool(ex.nonfinite)
            for st in self.stages:
                if skip:
                    st.discard_gradients()
                else:
                    st.update()
            loss, _ = ex.take_losses()
            ex.close_segment()
            ex.unit_clock.sync_barrier()
            ex.wall_clock.sync_barrier()
            self.steps += 1
            self.skipped_steps += int(skip)
            assert loss is not None
            return loss
        if not ex.active:
            ex.open_segment()
        ex.feed(xs, ts, [1.0 / self.k] * len(xs))
        self.steps += 1
        ex.run()
        loss, _ = ex.take_losses()
        return loss if loss is not None else torch.tensor(float("nan"))

    def flush(self) -> Tensor | None:
        """Drain an asynchronous pipeline: finish every backward and apply every pending
        gradient (a partial update group is applied as the mean over what arrived). Returns the
        mean loss of micro-batches whose forward completed during the flush (None if none).
        After a flush the next step() refills the pipeline from empty. A no-op for sync."""
        ex = self._executor
        if self.is_sync or not ex.active:
            return None
        ex.draining = True
        ex.N = ex.fed
        ex.run()
        loss, _ = ex.take_losses()
        ex.close_segment()
        ex.unit_clock.sync_barrier()
        ex.wall_clock.sync_barrier()
        return loss

    @property
    def flushed(self) -> bool:
        """True when no micro-batch is in flight and no gradient is pending."""
        return self._executor.in_flight() == 0

    def require_flushed(self, what: str) -> None:
        if not self.flushed:
            raise NotFlushedError(
                f"{what} needs a flushed pipeline, but {self._executor.in_flight()} micro-batch(es) of "
                f"schedule={self.schedule!r} are in flight; call pipe.flush() first"
            )

    # ------------------------------------------------------------------ facts

    def stats(self) -> dict[str, Any]:
        """Per-stage facts measured by the engine's own clock and counters.

        ``delays``: D_s set on the optimizers (derived by simulating the schedule);
        ``measured_delays``: {delay: micro-batches} per stage, counted when their gradient was
        applied; ``weight_versions``: peak distinct weight versions held per stage;
        ``weight_buffers``: peak buffers (live + slots); ``activation_peak``: peak micro-batches
        stashed per stage; ``bubble_fraction``: idle share of stage time with unit costs
        (F = 1, B = 2); ``bubble_fraction_wall``: the same with measured action times.
        """
        ex = self._executor
        return {
            "schedule": self.schedule,
            "stages": self.S,
            "chunks": self.M,
            "update_size": self.k,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "dropped_microbatches": ex.dropped,
            "updates": [st.updates for st in self.stages],
            "delays": list(self.delays),
            "measured_delays": [dict(sorted(st.delay_counts.items())) for st in self.stages],
            "weight_versions": [st.peak_versions for st in self.stages],
            "weight_buffers": [st.store.peak_buffers for st in self.stages],
            "weight_bytes": [st.store.bytes() for st in self.stages],
            "activation_peak": [st.stash.peak for st in self.stages],
            "bubble_fraction": ex.unit_clock.bubble(),
            "bubble_fraction_wall": ex.wall_clock.bubble(),
        }

    def reset_stats(self) -> None:
        """Restart the clocks and peak counters (e.g. after warm-up)."""
        ex = self._executor
        ex.unit_clock.reset()
        ex.wall_clock.reset()
        for st in self.stages:
            st.delay_counts.clear()
            st.stash.peak = len(st.stash)
            st.peak_versions = st.store.versions_held(st.updates)
            st.store.peak_buffers = 1 + len(st.store.slots)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically (requires a flushed pipeline)."""
        from engine.checkpoint import pipeline_state_dict

        return pipeline_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output; validated completely before anything changes."""
        from engine.checkpoint import load_pipeline_state_dict

        load_pipeline_state_dict(self, state)

    def __repr__(self) -> str:
        return (
            f"Pipeline(schedule={self.schedule!r}, stages={self.S}, chunks={self.M}, update_size={self.k}, "
            f"delays={self.delays}, checkpoint={self.checkpoint!r}, transport={self.transport!r})"
        )
