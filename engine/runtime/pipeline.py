"""``engine.Pipeline``: train a model split into stages with any schedule of ALGORITHMS.md.

This is the facade users meet. It validates the configuration (every invalid combination
fails here, before any weight exists in a pipeline; :mod:`config`), resolves the schedule once
(a built-in family or a user's program; :mod:`engine.schedule.spec`), builds one Stage per
module with its own optimizer over a flat weight arena (:mod:`build`), derives each stage's
delay D_s by simulating the schedule and writes it into the optimizer's param groups, and
hands the step protocol to the :class:`~engine.runtime.executor.Executor`.

With ``transport="local"`` every stage runs in this process, and that run is the exact
simulator of each method's staleness; with ``transport="gloo"``/``"nccl"`` (under torchrun)
each process builds and runs only its own stage, and the weights after any number of steps
equal the local run's bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import NotFlushedError, PipelineConfigError, ScheduleError
from engine.runtime import inputs as _inputs
from engine.runtime.amp import autocast_context, check_scaler_state
from engine.runtime.build import build_module, build_store, resolve_stage_specs
from engine.runtime.capture import ProgramCapture, refuse_program
from engine.runtime.config import DEFAULT_CHECKPOINT, PipelineConfig, check_options
from engine.runtime.config import resolve_mitigations
from engine.runtime.device_flags import check_skip_update
from engine.runtime.executor import Executor
from engine.runtime.graphs import attach_step_graphs
from engine.runtime.host_memory import keep_freed_host_memory
from engine.runtime.l2 import apply_l2
from engine.runtime.policy import SpecTrain, make_policy
from engine.runtime.stage import Stage
from engine.runtime.step_features import StepFeatures, check_step_features
from engine.runtime.step_features import attach as attach_features
from engine.runtime.streams import StageStreams
from engine.runtime.throughput import StepMeter, batch_size
from engine.runtime.ties import TiedGradients, tie_stages, with_declared
from engine.schedule.analysis import analyze, schedule_delays
from engine.schedule.catalog import FAMILIES
from engine.schedule.spec import ScheduleSpec, resolve_schedule

__all__ = ["Pipeline"]


class Pipeline:
    """A model split into stages trained with a pipeline schedule.

    Args:
        stages: list of ``nn.Module`` (stage 0 first), a list of factories ``() -> nn.Module``
            (one per stage: under gloo/NCCL a rank calls only its own, so no process ever
            materialises the whole model), or an ``nn.Sequential`` with ``balance``. A
            parameter shared by several stages (tied weights) is supported on synchronous
            schedules: later holders get a copy, kept equal by summing the holders' gradients
            before each update (``pipe.ties`` lists them; engine/runtime/ties.py).

            What passes between stages: a stage returns a tensor or a tree -- tuples, lists
            and dicts of tensors, nested, with constant leaves (None, numbers, strings) allowed
            -- and the next stage's module is called with it by one rule: a tuple is passed
            as positional arguments (``module(*out)``), a dict as keyword arguments
            (``module(**out)``), anything else (a tensor, a list) as one argument. A tensor
            leaf carries a gradient back only when it requires grad at the producer; masks,
            integer ids and other tensors that need no gradient travel with the activations
            (engine/runtime/trees.py).
        schedule: a family name -- "naive", "gpipe", "1f1b" (synchronous: gradients equal an
            unpipelined model's), "pipedream" (weight stashing), "2bw" (double buffering) or
            "pb" (pipelined backprop with live weights), "interleaved" (with
            ``virtual_stages``) -- or a schedule *program*: an
            :class:`engine.schedule.Schedule` or its text form (see ``engine.schedule.parse``),
            compute-only or with communication; it is lowered, validated and compiled once.
        chunks: M, micro-batches per mini-batch (per ``step()``); a program fixes its own.
        loss_fn: ``loss_fn(output, target) -> scalar``, the *mean* over the micro-batch's samples.
        optimizer: ``params -> optimizer``, called once per stage with that stage's parameters
            (its param groups become the stage's flat buckets). The pipeline writes each stage's
            delay D_s into ``group["delay"]``. Mitigations are options of the optimizer
            (engine.optim: ``spike_compensation``, ``prediction``, ``discrepancy_correction``).
        checkpoint: activation recomputation: "never" (default, the fastest: stages keep what
            autograd saved), "except_last" (all but the last stage re-run their forward in the
            backward) or "always" (``torch.utils.checkpoint``): about 1.4-1.5x per step for
            2-4x less activation memory (README, "Activation recomputation").
        transport: "local", "gloo" or "nccl" (one process per stage under ``torchrun
            --nproc-per-node S*data_parallel``: global rank r runs stage r % S of replica
            r // S; every rank calls ``step(inputs, targets)``, stage 0 reads ``inputs``, the
            last stage ``targets``; the returned loss is the same on every rank).
        update_size: k, micro-batches per optimizer step (sync schedules and 2bw: M; pipedream
            and pb: default 1).
        order: for "pb": "dataflow" (default; Kosson et al.'s ticks) or "1f1b".
        balance: layer counts per stage when ``stages`` is an ``nn.Sequential``, or "time" /
            "memory" to partition automatically (engine.partition; then also ``num_stages``,
            ``sample`` = one micro-batch of inputs, optional ``memory_cap_bytes``). Under
            gloo/NCCL global rank 0 decides and broadcasts the layer counts. Each layer's
            time is the median of ``balance_repeats`` runs; ``balance_profile``, a JSON file
            path, is reused when it exists (checked against the model) and written
            otherwise, so reruns cut at the same layers on a loaded machine.
        weight_prediction: which weights the forwards of an asynchronous live-weight schedule
            read: "lwp" (the optimizer's prediction, horizon D_s), "spectrain" or
            "spectrain_reuse". Default: "lwp" when the stage optimizer has ``prediction`` set.
            (How the prediction is computed -- "linear" or "momentum" -- is the optimizer's
            ``prediction`` option.)
        discrepancy_correction: PipeMare T2 (B reads w - tau_s * delta). Default: on when the
            stage optimizer has ``discrepancy_correction=True``; ``True`` with a plain torch
            optimizer makes the runtime track delta (decay ``correction_decay``).
        lr_scheduler: ``optimizer -> LRScheduler`` per stage, created after delays are set,
            stepped after every update.
        on_nonfinite: "raise", "skip" or "skip_update" a non-finite loss (see ``step``).
        trace: keep per-micro-batch records (t_F, t_B, update) in ``pipe.stages[s].records``.
        data_parallel: R replicas of every stage (gloo/NCCL only).
        timeout: seconds any wait on another rank may take (gloo/NCCL).
        cuda_streams: local transport: one CUDA stream per stage with event hand-offs, so
            stages overlap on one GPU. None (default): on when every stage is on one CUDA device.
        deferred_batch_norm: replace every BatchNorm by a
            :class:`~engine.runtime.batch_norm.DeferredBatchNorm`: each micro-batch is still
            normalised with its own statistics, but the running statistics are updated once
            per mini-batch, from all M micro-batches, as an unpipelined model's with the same
            batch. Off: each micro-batch updates them (recomputation never counts twice).
        l2_persistence: keep the stages' live weights in the GPU's persisting L2: True (the
            device's whole persisting L2) or a fraction in (0, 1] of it. The budget is split
            across the stages on the GPU in proportion to their weight bytes (a stage gets at
            most its largest bucket, which its window covers), the device-wide set-aside is set
            once to the sum, and each stage's window goes on its own stage stream (so this
            turns stage streams on, also for one stage). ``stats()["l2_persisting_bytes"]``
            says what each stage got and ``stats()["l2_persistence"]["reason"]`` why not. On
            CPU, or where the GPU or the build cannot persist, nothing is set, a warning says
            why and every stage reports 0 bytes: a warning, not an error, so that one training
            script runs in CPU CI and on a GPU. Local transport only.
        virtual_stages: v for ``schedule="interleaved"`` (interleaved 1F1B, synchronous):
            the stage modules are the ranks*v virtual stages, rank r running r, r+ranks, ...
            in Megatron's order. Under gloo/NCCL one process per rank (R = stages / v
            processes per replica) holds its v stages (engine/runtime/virtual.py).
        cuda_graphs: False; ``"optimizer"`` (or True): each stage's optimizer step replayed
            from a CUDA graph (runtime/graphs.py); ``"program"``: whole synchronous steps per
            batch shape (runtime/capture.py; ``stats()["capture"]`` says what ran eagerly and
            why). engine.optim's fused SGD/Adam/AdamW/NAdam on CUDA; refused otherwise.
        clip_grad_norm: ``max_norm`` of ``torch.nn.utils.clip_grad_norm_`` (``clip_norm_type``
            its p): synchronous schedules clip by the global norm over all stages and replicas,
            asynchronous ones each stage's update group by its own (runtime/clipping.py).
        autocast: ``torch.bfloat16``/``float16``: stage functions under ``torch.autocast``,
            weights float32; float16 adds loss scaling (``grad_scaler``; runtime/amp.py).
        offload_activations: saved activations wait in host memory (runtime/offload.py).
        ties: ties between factory-built stages (which cannot share a parameter object), e.g.
            ``[["0:tok.weight", "3:head.weight"]]``: checked at build, trained as an object tie
            (synchronous schedules; runtime/ties.py).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module] | nn.Sequential,
        *,
        schedule: Any,
        chunks: int | None = None,
        loss_fn: Callable[[Tensor, Any], Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        checkpoint: str = DEFAULT_CHECKPOINT,
        transport: str = "local",
        update_size: int | None = None,
        order: str | None = None,
        balance: Sequence[int] | str | None = None,
        weight_prediction: str | None = None,
        discrepancy_correction: bool | None = None,
        correction_decay: float = 0.1,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        on_nonfinite: str = "raise",
        trace: bool = False,
        num_stages: int | None = None,
        sample: Tensor | None = None,
        memory_cap_bytes: float | None = None,
        balance_repeats: int = 3,
        balance_profile: Any = None,
        data_parallel: int = 1,
        timeout: float = 300.0,
        cuda_streams: bool | None = None,
        deferred_batch_norm: bool = False,
        l2_persistence: bool | float = False,
        virtual_stages: int | None = None,
        cuda_graphs: bool | str = False,
        clip_grad_norm: float | None = None,
        clip_norm_type: float = 2.0,
        autocast: torch.dtype | None = None,
        grad_scaler: dict[str, Any] | None = None,
        offload_activations: bool = False,
        ties: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        fam = FAMILIES.get(schedule) if isinstance(schedule, str) else None
        self._meter = StepMeter()  # stats()["throughput"]
        self.features: StepFeatures = check_step_features(
            clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type, autocast=autocast,
            grad_scaler=grad_scaler, offload_activations=offload_activations,
        )
        self._virtual_stages = virtual_stages
        self.config: PipelineConfig = check_options(
            transport=transport, checkpoint=checkpoint, on_nonfinite=on_nonfinite,
            data_parallel=data_parallel, timeout=timeout, cuda_streams=cuda_streams,
            trace=trace, correction_decay=correction_decay, loss_fn=loss_fn,
            optimizer=optimizer, lr_scheduler=lr_scheduler,
            synchronous_hint=None if fam is None else fam.synchronous,
            schedule_name=schedule if isinstance(schedule, str) else "",
            l2_persistence=l2_persistence, cuda_graphs=cuda_graphs,
        )
        if self.config.distributed:
            from engine.runtime.rank import build_distributed

            build_distributed(
                self, stages, schedule, chunks, loss_fn, optimizer, update_size, order,
                balance, weight_prediction, discrepancy_correction, lr_scheduler,
                num_stages, sample, memory_cap_bytes, deferred_batch_norm=deferred_batch_norm,
                balance_repeats=balance_repeats, balance_profile=balance_profile, tied=ties,
            )
            return
        if isinstance(balance, str):
            from engine.runtime.balance import auto_balance

            balance = auto_balance(
                stages, balance, schedule, chunks, order, num_stages, sample, memory_cap_bytes,
                repeats=balance_repeats, profile=balance_profile,
            )
        specs = resolve_stage_specs(stages, balance)
        self.balance = list(balance) if balance is not None else None
        spec = self._resolve(schedule, len(specs), chunks, update_size, order)
        refuse_program(spec, self.config, self.features)
        modules = [build_module(m, s) for s, m in enumerate(specs)]
        if deferred_batch_norm:
            from engine.runtime.batch_norm import convert_deferred_batch_norm

            modules = [convert_deferred_batch_norm(m, spec.chunks) for m in modules]
        found = tie_stages(modules, spec)
        ties = with_declared(found, ties, spec, dict(enumerate(modules)))[0]
        built = [build_store(m, s, optimizer, self.config.cuda_graphs) for s, m in enumerate(modules)]
        self._finish(
            spec, modules, built, list(range(spec.stages)), loss_fn, weight_prediction,
            discrepancy_correction, lr_scheduler,
        )
        self.ties = ties
        self._executor.ties = TiedGradients(ties, self.stages) if ties else None
        attach_features(self)

    # ------------------------------------------------------------------ construction

    def _resolve(
        self, schedule: Any, S: int, chunks: int | None, update_size: int | None, order: str | None
    ) -> ScheduleSpec:
        try:
            return resolve_schedule(
                schedule, stages=S, chunks=chunks, update_size=update_size, order=order,
                virtual_stages=self._virtual_stages,
            )
        except ScheduleError:
            raise  # a broken program: the error names the stage, the action and the rule
        except (ValueError, TypeError) as exc:
            raise PipelineConfigError(str(exc)) from None

    def _finish(
        self,
        spec: ScheduleSpec,
        modules: list[nn.Module],
        built: list[Any],
        indices: list[int],
        loss_fn: Callable[[Tensor, Any], Tensor],
        weight_prediction: str | None,
        discrepancy_correction: bool | None,
        lr_scheduler: Any,
        streams: StageStreams | None = None,
    ) -> None:
        """Policies, stages, delays and the executor, once modules and stores exist."""
        cfg = self.config
        self.spec = spec
        bridges = [b for _, b in built]
        prediction, correction = resolve_mitigations(
            spec, bridges, weight_prediction, discrepancy_correction
        )
        self.weight_prediction = prediction
        self.discrepancy_correction = correction
        device_flags = cfg.on_nonfinite == "skip_update" and check_skip_update(spec, bridges)
        if spec.program is not None:
            self.delays = list(analyze(spec.program).delays)
        else:
            self.delays = list(
                schedule_delays(spec.name, spec.stages, spec.chunks, spec.update_size, spec.order)
            )
        stages: list[Stage] = []
        for (store, bridge), module, s in zip(built, modules, indices, strict=True):
            policy = make_policy(
                spec.weights, spec.synchronous, spec.chunks, spec.stages, s, prediction, correction
            )
            if bridge is not None:
                bridge.set_delay(self.delays[s])
                if isinstance(policy, SpecTrain) and bridge.is_engine:
                    bridge.set_group_option("prediction_horizon", float(policy.s_f))
                if correction and not bridge.keeps_delta:
                    bridge.enable_fallback_correction(cfg.correction_decay)
                if device_flags:
                    bridge.enable_skip_flags()
            st = Stage(
                s, spec.stages, module, store, bridge, policy, cfg.recompute(s, spec.stages),
                loss_fn if s == spec.stages - 1 else None, trace=cfg.trace,
            )
            if lr_scheduler is not None and bridge is not None:
                st.scheduler = lr_scheduler(bridge.opt)
            stages.append(st)
        self.stages = stages
        devices = {p.device for st in stages for p in st.store.params}
        if not hasattr(self, "device"):
            self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        if not hasattr(self, "layout"):
            self.layout = None
            self.replicas = 1
        if any(d.type == "cpu" for d in devices) or not devices:
            keep_freed_host_memory()
        if streams is None:
            streams = self._make_streams(stages, cfg.cuda_streams, l2=bool(cfg.l2_persistence))
        self._streams = streams
        if cfg.cuda_graphs == "optimizer":
            attach_step_graphs(stages)
        self._l2 = apply_l2(stages, streams, cfg.l2_persistence, owner=self)
        self._executor = Executor(
            spec, stages, on_nonfinite=cfg.on_nonfinite, streams=streams, device_flags=device_flags
        )
        self._checked: set[Any] = set()
        self._capture = ProgramCapture(self._executor) if cfg.cuda_graphs == "program" else None

    @staticmethod
    def _make_streams(stages: list[Stage], want: bool | None, l2: bool = False) -> StageStreams:
        """One CUDA stream per stage when every stage lives on one CUDA device."""
        devices = {p.device for st in stages for p in st.store.params}
        on_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
        if l2 and not on_cuda and any(d.type == "cuda" for d in devices):
            raise PipelineConfigError(
                "l2_persistence sets each stage's window on its stage stream, and stage streams "
                f"need every stage on one CUDA device, found {sorted(map(str, devices))}; put "
                "the stages on one GPU or drop l2_persistence"
            )
        if want is None:
            want = on_cuda and (len(stages) > 1 or l2)
        if want and not on_cuda:
            raise PipelineConfigError(
                "cuda_streams=True needs every stage's parameters on one CUDA device, found "
                f"{sorted(map(str, devices))}; move the stages with .cuda() or pass cuda_streams=False"
            )
        device = next(iter(devices)) if (want and devices) else None
        return StageStreams([st.index for st in stages], device)

    # ------------------------------------------------------------------ facts in words

    @property
    def num_stages(self) -> int:
        return self.spec.stages

    @property
    def chunks(self) -> int:
        return self.spec.chunks

    @property
    def update_size(self) -> int:
        return self.spec.update_size

    @property
    def schedule(self) -> str:
        return self.spec.name

    @property
    def order(self) -> str:
        return self.spec.order

    @property
    def checkpoint(self) -> str:
        return self.config.checkpoint

    @property
    def transport(self) -> str:
        return self.config.transport

    @property
    def on_nonfinite(self) -> str:
        return self.config.on_nonfinite

    @property
    def is_sync(self) -> bool:
        return self.spec.synchronous

    @property
    def steps(self) -> int:
        return self._executor.steps

    @property
    def skipped_steps(self) -> int:
        return self._executor.skipped_steps

    # ------------------------------------------------------------------ running

    def step(self, inputs: Any, targets: Any) -> Tensor:
        """Run one mini-batch of ``chunks`` micro-batches; return its mean loss (over samples).

        ``inputs`` is a tensor or a tree of them, passed to stage 0's module by the rule of
        the ``stages`` argument (a tuple as positional arguments, a dict as keyword
        arguments); ``targets`` may be any tree and reaches ``loss_fn(output, targets)``
        unchanged, one micro-batch slice at a time. Every tensor leaf of both is split on
        dim 0 (all need the same batch size; a mismatch is refused naming both leaves); a
        non-tensor leaf is passed to every micro-batch as it is.

        Synchronous schedules update every stage once at the end; the gradient equals an
        unpipelined model's with a mean-reduced loss. Asynchronous schedules keep the pipeline
        full across calls: every forward of this mini-batch completes within the call (so the
        returned loss is this mini-batch's), but backwards and updates of the last micro-batches
        run in later calls or at ``flush()``.

        A non-finite loss with ``on_nonfinite="raise"``: synchronous schedules roll the step
        back (nothing changes) and raise NonFiniteLossError; asynchronous ones drop that
        micro-batch at every stage (zero gradient) and raise with the rest of the step pending
        (it runs at the next call). With ``"skip"`` a synchronous step applies no update at
        any stage (``stats()["skipped_steps"]``); an asynchronous micro-batch is dropped at
        every stage and the rest of its update group is renormalised (one host read of the
        loss per micro-batch). ``"skip_update"`` reads nothing: each loss becomes a device flag
        and every stage's update whose group holds a flagged micro-batch is skipped whole, on
        the device (engine.optim optimizers only; synchronous schedules: as ``"skip"``);
        ``stats()`` counts them.

        Any other exception inside the step: see :mod:`engine.runtime.executor` (synchronous
        steps roll back; asynchronous ones stop at an action boundary, dropping the micro-batch
        whose forward or backward raised). The exception carries a note saying which.
        """
        t0 = time.perf_counter()
        loss = self._step(inputs, targets)
        self._meter.record(time.perf_counter() - t0, *batch_size(inputs, targets))
        return loss

    def _step(self, inputs: Any, targets: Any) -> Tensor:
        if self.config.distributed:
            from engine.runtime.rank_step import rank_step

            return rank_step(self, inputs, targets)
        xs, ts, sizes = _inputs.split(inputs, targets, self.spec.chunks)
        key = _inputs.input_key(xs[0], ts[0])
        if key not in self._checked:
            with self._autocast():  # the shapes autocast gives
                _inputs.dry_run(
                    [st.module for st in self.stages], xs[0], ts[0], self.stages[-1].loss_fn  # type: ignore[arg-type]
                )
            self._checked.add(key)
        result = (self._capture or self._executor).run_step(xs, ts, sizes)
        if result.loss is None:
            return torch.tensor(float("nan"))
        return result.loss

    def trace(self, path: str | os.PathLike[str]) -> contextlib.AbstractContextManager[Any]:
        """``with pipe.trace("run.json"): ...``: record every action run inside the block and
        write a Chrome/Perfetto trace-event file at its end (engine/runtime/trace.py). Under
        gloo/NCCL every rank enters the block; rank 0 writes one file for all ranks."""
        from engine.runtime.trace import trace

        return trace(self, path)

    def _autocast(self) -> Any:
        a = self.stages[0].autocast if self.stages else None
        return autocast_context(*a) if a is not None else contextlib.nullcontext()

    def evaluate(self, inputs: Tensor, chunks: int | None = None) -> Tensor:
        """Forward only: the last stage's module outputs for ``inputs`` (before ``loss_fn``),
        concatenated on dim 0, computed in ``chunks`` micro-batches (default: the pipeline's).

        Reads each stage's *live* weights -- the newest update, for an asynchronous pipeline
        too (not the versions its in-flight micro-batches read, and no prediction) -- in eval
        mode (dropout off, BatchNorm on its running statistics) without autograd. Nothing a
        training step keeps is touched: in-flight micro-batches, kept weight versions,
        gradients, counters and the RNG state are as before, so training continues exactly
        as if ``evaluate`` had not been called. Under gloo/NCCL every rank calls it (stage 0
        reads ``inputs``) and every rank gets the outputs. With ``autocast=`` every stage runs
        under the same autocast state as in a step."""
        from engine.runtime.evaluation import evaluate

        return evaluate(self, inputs, chunks)

    def flush(self) -> Tensor | None:
        """Drain an asynchronous pipeline: finish every backward and apply every pending
        gradient (a partial update group is applied as the mean over what arrived). Returns the
        mean loss of micro-batches whose forward completed during the flush (None if none).
        After a flush the next step() refills the pipeline from empty. A no-op for sync."""
        return self._executor.drain()

    @property
    def flushed(self) -> bool:
        """True when no micro-batch is in flight and no gradient is pending."""
        return self._executor.in_flight() == 0

    def require_flushed(self, what: str) -> None:
        if not self.flushed:
            raise NotFlushedError(
                f"{what} needs a flushed pipeline, but micro-batches of {self.spec.describe()} "
                "are in flight; call pipe.flush() first"
            )

    # ------------------------------------------------------------------ facts

    def stats(self) -> dict[str, Any]:
        """Per-stage facts measured by the engine's own clock and counters; each key is
        described in :func:`engine.runtime.pipeline_stats.pipeline_stats`."""
        from engine.runtime.pipeline_stats import pipeline_stats

        return pipeline_stats(self)

    def reset_stats(self) -> None:
        """Restart the clock and peak counters (e.g. after warm-up)."""
        self._executor.clock.reset()
        self._meter.reset()
        for st in self.stages:
            st.busy_ns = 0
            st.delay_counts.clear()
            st.stash.peak = len(st.stash)
            st.store.reset_peaks()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically; micro-batches in flight are saved and
        rebuilt on load (engine.runtime.inflight says when that is possible)."""
        from engine.runtime.state import pipeline_state_dict

        state = pipeline_state_dict(self)
        if self._executor.loss_scaler is not None:  # float16: the scale and its growth tracker
            state["loss_scaler"] = self._executor.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Load ``state_dict()`` output; validated completely before anything changes. The
        stage optimizers must have the checkpoint's hyper-parameters unless
        ``override_hyperparameters`` (then the checkpoint's values win, as torch's)."""
        from engine.runtime.state import load_pipeline_state_dict

        scaler = self._executor.loss_scaler
        check_scaler_state(scaler, state)  # (float16's scale: before anything changes)
        load_pipeline_state_dict(self, {k: v for k, v in state.items() if k != "loss_scaler"},
                                 override_hyperparameters)
        if scaler is not None:
            scaler.load_state_dict(state["loss_scaler"])

    def __repr__(self) -> str:
        return (
            f"Pipeline(schedule={self.spec.name!r}, stages={self.spec.stages}, "
            f"chunks={self.spec.chunks}, update_size={self.spec.update_size}, "
            f"delays={self.delays}, checkpoint={self.config.checkpoint!r}, "
            f"transport={self.config.transport!r})"
        )
