"""``engine.Pipeline``: train a model split into stages with any schedule of ALGORITHMS.md.

This is the facade users meet. It validates the configuration (every invalid combination
fails here, before any weight exists in a pipeline; :mod:`config`) and calls one builder --
:func:`~engine.runtime.assemble.build_local` or, under gloo/NCCL,
:func:`~engine.runtime.ranks.rank_build.build_rank` -- which resolves the schedule once (a built-in
family or a user's program; :mod:`engine.schedule.spec`), builds one Stage per module with its
own optimizer over a flat weight arena (:mod:`build`), derives each stage's delay D_s by
simulating the schedule and writes it into the optimizer's param groups, and returns the
:class:`~engine.runtime.parts.PipelineParts` (stages, executor, streams, ...) the facade holds;
``step``/``flush``/``stats``/``state_dict`` delegate to them. Nothing in ``engine/runtime/``
imports this module: it is the leaf at the top of the import graph.

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
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from engine.runtime.stage import inputs as _inputs
from engine.runtime.precision import check_scaler_state
from engine.runtime.setup.config import DEFAULT_CHECKPOINT, PipelineConfig, check_options
from engine.runtime.parts import BuildRequest, PipelineParts
from engine.runtime.setup.step_features import StepFeatures, check_step_features
from engine.runtime.state.throughput import StepMeter, batch_size
from engine.schedule.auto import CHOOSERS, Choice
from engine.schedule.catalog import lookup
from engine.schedule.spec import ScheduleSpec

if TYPE_CHECKING:
    from engine.runtime.stage.stage import Stage

__all__ = ["Pipeline"]

_T = TypeVar("_T")


class _Part(Generic[_T]):
    """``pipe.<name>``: the read-only view of ``pipe.parts.<name>``, what the builder returned."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, pipe: Any, owner: type | None = None) -> _T:
        return self if pipe is None else getattr(pipe.parts, self.name)  # type: ignore[return-value]

    def __set__(self, pipe: Any, value: Any) -> None:
        raise AttributeError(f"Pipeline.{self.name} is read-only (pipe.parts.{self.name})")


class Pipeline:
    """A model split into stages trained with a pipeline schedule.

    Args:
        stages: list of ``nn.Module`` (stage 0 first), a list of factories ``() -> nn.Module``
            (one per stage: under gloo/NCCL a rank calls only its own, so no process ever
            materialises the whole model), or an ``nn.Sequential`` with ``balance``. A
            parameter (or module) shared by several stages is a tie (``pipe.ties``):
            synchronous schedules give later holders a copy, kept equal by summing the
            holders' gradients before each update (engine/runtime/ties/groups.py); asynchronous
            ones carry the owner's value to the later holders (runtime/ties/carry.py).

            What passes between stages: a stage returns a tensor or a tree -- tuples, lists
            and dicts of tensors, nested, with constant leaves (None, numbers, strings) allowed
            -- and the next stage's module is called with it by one rule: a tuple is passed
            as positional arguments (``module(*out)``), a dict as keyword arguments
            (``module(**out)``), anything else (a tensor, a list) as one argument. A tensor
            leaf carries a gradient back only when it requires grad at the producer; masks,
            integer ids and other tensors that need no gradient travel with the activations
            (engine/runtime/stage/trees.py).
        schedule: a family of the catalog (``engine.schedule.NAMES``; one row each in
            engine/schedule/catalog.py): the synchronous ones (gradients equal an unpipelined
            model's) "naive", "gpipe", "1f1b", "zbh1", "interleaved" and "looped_bfs" (with
            ``virtual_stages``), "zbv", "vhalf", "vmin" and "dualpipev" (two stages per rank
            as a V), and the asynchronous "pipedream" (weight stashing), "2bw" (double
            buffering), "pb" (pipelined backprop with live weights); or "auto" / "auto-async",
            the fastest (synchronous / any) family whose predicted memory per rank fits
            ``memory_cap_bytes``, from the stages' costs profiled on ``sample`` or read from
            ``balance_profile`` (engine/schedule/auto.py; refused under gloo/NCCL); or a
            schedule *program*: an :class:`engine.schedule.Schedule` or its text form (see
            ``engine.schedule.parse``), compute-only or with communication; it is lowered,
            validated and compiled once.
        chunks: M, micro-batches per mini-batch (per ``step()``); a program fixes its own.
        loss_fn: ``loss_fn(output, target) -> scalar``, the *mean* over the micro-batch's samples.
        optimizer: ``params -> optimizer``, called once per stage with that stage's parameters
            (its param groups become the stage's flat buckets). The pipeline writes each stage's
            delay D_s into ``group["delay"]``. Mitigations of the update rule are options of the
            optimizer (engine.optim: ``spike_compensation``, ``delay_compensation``,
            PipeMareLR); those that change which weights F and B read are the pipeline's
            (``weight_prediction``, ``discrepancy_correction``).
        checkpoint: activation recomputation: "never" (default, the fastest: stages keep what
            autograd saved), "except_last" (all but the last stage re-run their forward in the
            backward) or "always" (``torch.utils.checkpoint``): slower steps for less
            activation memory (README, "Activation recomputation", has the measurements).
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
        weight_prediction: the switch of weight prediction, i.e. which weights the forwards of
            an asynchronous live-weight schedule read: "lwp" (the optimizer's prediction,
            horizon D_s), "spectrain" or "spectrain_reuse"; None (default): off. The pipeline
            asks an engine optimizer to predict (``prediction="linear"``, unless it was built
            with ``prediction="momentum"``: that option chooses the form); a plain torch
            optimizer's prediction is computed by the runtime. Deprecated spelling (removed in
            0.3): no pipeline option and an engine optimizer built with ``prediction``.
        discrepancy_correction: the switch of PipeMare T2 (B reads w - tau_s * delta): the
            pipeline asks an engine optimizer to keep delta (decay ``correction_decay``), or
            tracks it itself for a plain torch optimizer. Deprecated spelling (removed in
            0.3): no pipeline option and an engine optimizer built with
            ``discrepancy_correction=True``.
        lr_scheduler: ``optimizer -> LRScheduler`` per stage, created after delays are set,
            stepped after every update.
        on_nonfinite: "raise", "skip" or "skip_update" a non-finite loss (see ``step``).
        trace: keep per-micro-batch records (t_F, t_B, update) in ``pipe.stages[s].records``.
        data_parallel: R replicas of every stage (gloo/NCCL only).
        timeout: seconds any wait on another rank may take (gloo/NCCL).
        cuda_streams: local transport: one CUDA stream per stage with event hand-offs, so
            stages overlap on one GPU. None (default): on where an asynchronous schedule's
            windows are captured (``cuda_graphs="program"``) and with ``l2_persistence``; off
            otherwise, where they were measured to lose
            (engine.runtime.exec.streams.default_stage_streams says why).
        deferred_batch_norm: replace every BatchNorm by a
            :class:`~engine.runtime.setup.batch_norm.DeferredBatchNorm`: each micro-batch is still
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
            processes per replica) holds its v stages (engine/runtime/ranks/virtual.py).
        cuda_graphs: False; ``"optimizer"`` (or True): each stage's optimizer step replayed
            from a CUDA graph (runtime/capture/optimizer_graphs.py); ``"program"``: whole synchronous steps per
            batch shape (runtime/capture/synchronous.py; ``stats()["capture"]`` says what ran eagerly and
            why). engine.optim's fused SGD/Adam/AdamW/NAdam on CUDA; refused otherwise.
        clip_grad_norm: ``max_norm`` of ``torch.nn.utils.clip_grad_norm_`` (``clip_norm_type``
            its p): synchronous schedules clip by the global norm over all stages and replicas,
            asynchronous ones each stage's update group by its own (runtime/exec/clipping.py).
        autocast: ``torch.bfloat16``/``float16``: stage functions under ``torch.autocast``,
            weights float32; float16 adds loss scaling (``grad_scaler``; runtime/precision.py).
        offload_activations: saved activations wait in host memory (runtime/stage/offload.py).
        ties: ties between factory-built stages (which cannot share a parameter object), e.g.
            ``[["0:tok.weight", "3:head.weight"]]``: checked at build, trained as an object tie
            (runtime/ties/groups.py).
        mesh: a DeviceMesh with dims pp, dp, tp (gloo/NCCL; tensor parallelism: runtime/ranks/mesh.py).
        activation_shapes: how a multi-process pipeline learns each activation's shapes.
            "inputs" (default): they follow from the first stage's input shapes (static
            shapes, or a sequence length that changes with the batch); under NCCL the first
            stage announces, once per step, the micro-batches whose input shapes change, and
            activations travel without a header or a host read. "any": they may also depend
            on the data (a stage that trims padding); under NCCL each activation's shapes
            then travel first as a host message on the control plane (one message each, no
            device synchronisation). gloo handles both alike (transport/gloo.py).
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
        mesh: Any = None,
        activation_shapes: str = "inputs",
    ) -> None:
        self._meter = StepMeter()  # stats()["throughput"]
        #: what schedule="auto" chose and why (stats()["schedule_choice"]); None otherwise
        self.schedule_choice: Choice | None = None
        if isinstance(schedule, str) and schedule in CHOOSERS:
            from engine.runtime.setup.auto_schedule import choose_for_pipeline

            self.schedule_choice = choose_for_pipeline(
                stages, schedule, chunks=chunks, memory_cap_bytes=memory_cap_bytes,
                balance=balance, sample=sample, profile=balance_profile,
                repeats=balance_repeats, distributed=transport in ("gloo", "nccl"),
                given=dict(virtual_stages=virtual_stages, order=order, update_size=update_size),
            )
            schedule = self.schedule_choice.family
            virtual_stages = self.schedule_choice.virtual_stages
            order = self.schedule_choice.order
        fam = lookup(schedule)
        features: StepFeatures = check_step_features(
            clip_grad_norm=clip_grad_norm, clip_norm_type=clip_norm_type, autocast=autocast,
            grad_scaler=grad_scaler, offload_activations=offload_activations,
        )
        config: PipelineConfig = check_options(
            transport=transport, checkpoint=checkpoint, on_nonfinite=on_nonfinite,
            data_parallel=data_parallel, timeout=timeout, cuda_streams=cuda_streams,
            trace=trace, correction_decay=correction_decay, loss_fn=loss_fn,
            optimizer=optimizer, lr_scheduler=lr_scheduler,
            synchronous_hint=None if fam is None else fam.synchronous,
            schedule_name=schedule if isinstance(schedule, str) else "",
            l2_persistence=l2_persistence, cuda_graphs=cuda_graphs, mesh=mesh,
            activation_shapes=activation_shapes,
        )
        request = BuildRequest(
            stages=stages, schedule=schedule, chunks=chunks, loss_fn=loss_fn,
            optimizer=optimizer, config=config, features=features, update_size=update_size,
            order=order, balance=balance, weight_prediction=weight_prediction,
            discrepancy_correction=discrepancy_correction, lr_scheduler=lr_scheduler,
            num_stages=num_stages, sample=sample, memory_cap_bytes=memory_cap_bytes,
            balance_repeats=balance_repeats, balance_profile=balance_profile,
            deferred_batch_norm=deferred_batch_norm, virtual_stages=virtual_stages, ties=ties,
            mesh=mesh,
        )
        if config.distributed:
            from engine.runtime.ranks.rank_build import build_rank

            self.parts: PipelineParts = build_rank(request)
        else:
            from engine.runtime.assemble import build_local

            self.parts = build_local(request)
        self._checked: set[Any] = set()  # input shapes the dry run has checked

    # ------------------------------------------------------------------ the parts
    # (read-only views of what the builder returned: ``pipe.parts``, engine/runtime/parts.py)

    spec: _Part[ScheduleSpec] = _Part()
    config: _Part[PipelineConfig] = _Part()
    features: _Part[StepFeatures] = _Part()
    stages: _Part[list[Stage]] = _Part()
    delays: _Part[list[int]] = _Part()
    device: _Part[torch.device] = _Part()
    #: gloo/NCCL: this rank's place in the replica x stage layout; None locally
    layout: _Part[Any] = _Part()
    replicas: _Part[int] = _Part()
    balance: _Part[list[int] | None] = _Part()
    ties: _Part[list[Any]] = _Part()
    weight_prediction: _Part[str | None] = _Part()
    discrepancy_correction: _Part[bool] = _Part()

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
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree of a ``mesh=`` pipeline (1 without a ``tp`` dimension)."""
        return getattr(self.parts.layout, "tp", 1)

    @property
    def on_nonfinite(self) -> str:
        return self.config.on_nonfinite

    @property
    def is_sync(self) -> bool:
        return self.spec.synchronous

    @property
    def steps(self) -> int:
        return self.parts.executor.steps

    @property
    def skipped_steps(self) -> int:
        return self.parts.executor.skipped_steps

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

        Any other exception inside the step: see :mod:`engine.runtime.exec.executor` (synchronous
        steps roll back; asynchronous ones stop at an action boundary, dropping the micro-batch
        whose forward or backward raised). The exception carries a note saying which.
        """
        t0 = time.perf_counter()
        loss = self._step(inputs, targets)
        self._meter.record(time.perf_counter() - t0, *batch_size(inputs, targets))
        return loss

    def _step(self, inputs: Any, targets: Any) -> Tensor:
        if self.config.distributed:
            from engine.runtime.ranks.rank_step import rank_step

            return rank_step(self.parts, inputs, targets)
        xs, ts, sizes = _inputs.split(inputs, targets, self.spec.chunks)
        key = _inputs.input_key(xs[0], ts[0])
        if key not in self._checked:
            with self.parts.autocast():  # the shapes autocast gives
                _inputs.dry_run(
                    [st.module for st in self.stages], xs[0], ts[0], self.stages[-1].loss_fn  # type: ignore[arg-type]
                )
            self._checked.add(key)
        result = self.parts.runner.run_step(xs, ts, sizes)
        if result.loss is None:
            return torch.tensor(float("nan"))
        return result.loss

    def trace(self, path: str | os.PathLike[str]) -> contextlib.AbstractContextManager[Any]:
        """``with pipe.trace("run.json"): ...``: record every action run inside the block and
        write a Chrome/Perfetto trace-event file at its end (engine/runtime/stage/trace.py). Under
        gloo/NCCL every rank enters the block; rank 0 writes one file for all ranks. Called
        as a statement, never entered, it records nothing and warns (RuntimeWarning)."""
        from engine.runtime.stage.trace import trace

        p = self.parts
        rank = p.layout.rank if p.layout is not None else None
        group = None
        if rank is not None:  # host objects: the world's gloo control group (NCCL included)
            from engine.runtime.ranks.transport.control import world_group

            group = world_group(p.config.timeout)
        return trace(path, p.stages, p.executor, rank, group)

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
        from engine.runtime.state.evaluation import evaluate

        return evaluate(self.parts, inputs, chunks)

    def flush(self) -> Tensor | None:
        """Drain an asynchronous pipeline: finish every backward and apply every pending
        gradient (a partial update group is applied as the mean over what arrived). Returns the
        mean loss of micro-batches whose forward completed during the flush (None if none).
        After a flush the next step() refills the pipeline from empty. A no-op for sync."""
        return self.parts.executor.drain()

    @property
    def flushed(self) -> bool:
        """True when no micro-batch is in flight and no gradient is pending."""
        return self.parts.flushed

    def require_flushed(self, what: str) -> None:
        """Raise NotFlushedError naming ``what`` unless :attr:`flushed`."""
        self.parts.require_flushed(what)

    # ------------------------------------------------------------------ facts

    def stats(self) -> dict[str, Any]:
        """Per-stage facts measured by the engine's own clock and counters; each key is
        described in :func:`engine.runtime.state.pipeline_stats.pipeline_stats`."""
        from engine.runtime.state.pipeline_stats import pipeline_stats

        out = pipeline_stats(self.parts, self._meter)
        choice = self.schedule_choice
        out["schedule_choice"] = None if choice is None else choice.as_dict()
        return out

    def reset_stats(self) -> None:
        """Restart the clock and peak counters (e.g. after warm-up)."""
        self.parts.executor.clock.reset()
        self._meter.reset()
        for st in self.stages:
            st.busy_ns = 0
            st.delay_counts.clear()
            st.stash.peak = len(st.stash)
            st.store.reset_peaks()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically; micro-batches in flight are saved and
        rebuilt on load (engine.runtime.state.inflight says when that is possible)."""
        from engine.runtime.state.state import pipeline_state_dict

        state = pipeline_state_dict(self.parts)
        if self.parts.executor.loss_scaler is not None:  # float16: the scale and its growth tracker
            state["loss_scaler"] = self.parts.executor.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Load ``state_dict()`` output; validated completely before anything changes. The
        stage optimizers must have the checkpoint's hyper-parameters unless
        ``override_hyperparameters`` (then the checkpoint's values win, as torch's)."""
        from engine.runtime.state.state import load_pipeline_state_dict

        scaler = self.parts.executor.loss_scaler
        check_scaler_state(scaler, state)  # (float16's scale: before anything changes)
        load_pipeline_state_dict(self.parts, {k: v for k, v in state.items() if k != "loss_scaler"},
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
