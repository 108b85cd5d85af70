"""``engine.Pipeline``: train a model split into stages with any schedule of ALGORITHMS.md.

This is the user-facing object. It validates the configuration (every invalid combination
fails here, before any weight exists in a pipeline), builds one Stage per module with its own
optimizer, derives each stage's delay D_s by simulating the schedule
(:func:`engine.schedule.schedule_delays`) and writes it into the optimizer's param groups, and
drives the Executor over the schedule IR's action streams. With ``transport="local"`` every
stage runs in this process, and that run is the exact simulator of each method's staleness;
with ``transport="gloo"``/``"nccl"`` (under torchrun) each process builds and runs only its own
stage, and the weights after any number of steps equal the local run's bit for bit on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine.runtime.errors import (
    NonFiniteLossError,
    NotFlushedError,
    PipelineConfigError,
    PipelineInputError,
)
from engine.runtime.executor import Executor
from engine.runtime.plan import SCHEDULES, SYNC_SCHEDULES
from engine.runtime.policy import make_policy
from engine.runtime.stage import Stage
from engine.schedule.analysis import schedule_delays

__all__ = ["Pipeline", "CHECKPOINT_MODES", "PREDICTIONS"]

CHECKPOINT_MODES = ("never", "except_last", "always")
PREDICTIONS = ("lwp", "spectrain", "spectrain_reuse")
TRANSPORTS = ("local", "gloo", "nccl")

StageSpec = nn.Module | Callable[[], nn.Module]


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
        stages: list of ``nn.Module`` (stage 0 first), a list of factories ``() -> nn.Module``
            (one per stage: under gloo/NCCL a rank calls only its own, so no process ever
            materialises the whole model), or an ``nn.Sequential`` with ``balance``.
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
        transport: "local" (every stage in this process; on one GPU each stage gets its own
            CUDA stream, see ``cuda_streams``), "gloo" (one process per stage, CPU tensors) or
            "nccl" (one process per stage and GPU). The last two run under ``torchrun
            --nproc-per-node S*data_parallel``: global rank r runs stage r % S of replica
            r // S. Every rank calls ``step(inputs, targets)``; stage 0 reads ``inputs``, the
            last stage ``targets`` (other ranks may pass None); the returned loss is the same
            on every rank (broadcast from the last stage, averaged over replicas).
        update_size: k, micro-batches per optimizer step. Sync schedules and 2bw: M (default);
            pipedream and pb: default 1.
        order: for "pb": "dataflow" (default; Kosson et al.'s ticks) or "1f1b".
        balance: layer counts per stage when ``stages`` is an ``nn.Sequential``, or "time" /
            "memory" to partition automatically (engine.partition; then also ``num_stages``,
            ``sample`` = one micro-batch of inputs, optional ``memory_cap_bytes``). Under
            gloo/NCCL global rank 0 profiles and decides, and broadcasts the layer counts
            (timings differ between processes; every rank must cut at the same layers);
            ``pipe.balance`` holds the result on every rank.
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
        data_parallel: R replicas of every stage (gloo/NCCL only); each rank passes its
            replica's shard of the batch, and gradients are averaged over the replicas at
            every update (so R replicas with batch B each equal one replica with batch R*B).
        timeout: seconds any wait on another rank may take (gloo/NCCL) before every
            surviving rank raises :class:`~engine.runtime.transport.PeerError` naming the peer.
        cuda_streams: local transport: one CUDA stream per stage with event hand-offs, so
            stages overlap on one GPU. None (default): on when every stage is on one CUDA device.
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
        data_parallel: int = 1,
        timeout: float = 300.0,
        cuda_streams: bool | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise PipelineConfigError(
                f"transport={transport!r} is not available; use 'local' (one process, exact "
                "simulation of every schedule), 'gloo' (CPU, one process per stage) or 'nccl' "
                "(GPU, one process per stage)"
            )
        if schedule not in SCHEDULES:
            raise PipelineConfigError(
                f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        distributed = transport != "local"
        if (
            not isinstance(data_parallel, int)
            or isinstance(data_parallel, bool)
            or data_parallel < 1
        ):
            raise PipelineConfigError(f"data_parallel={data_parallel!r} must be an int >= 1")
        if data_parallel > 1 and not distributed:
            raise PipelineConfigError(
                f"data_parallel={data_parallel} needs one process per (replica, stage): use "
                "transport='gloo' or 'nccl' under torchrun"
            )
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise PipelineConfigError(f"timeout={timeout!r} must be a positive number of seconds")
        if distributed and on_nonfinite == "skip" and schedule not in SYNC_SCHEDULES:
            raise PipelineConfigError(
                f"on_nonfinite='skip' with schedule={schedule!r} and transport={transport!r}: "
                "dropping one micro-batch at every stage of an asynchronous pipeline needs all "
                "stages in one process. Use on_nonfinite='raise' (every rank raises at the end of "
                "the step) or transport='local'."
            )
        if cuda_streams and distributed:
            raise PipelineConfigError(
                "cuda_streams is for the local transport; under NCCL each rank has one compute "
                "stream and the transport its communication stream"
            )
        self.distributed = distributed
        self.replicas = data_parallel
        self.timeout = float(timeout)
        self._rank: Any = None
        layout: Any = None
        if distributed:
            from engine.runtime.transport.layout import init_distributed

            try:
                init_distributed(transport, self.timeout)
            except ValueError as exc:
                raise PipelineConfigError(str(exc)) from None
        if isinstance(balance, str):
            args = (stages, balance, schedule, chunks, order, num_stages, sample, memory_cap_bytes)
            if distributed:
                from engine.runtime.distributed import broadcast_balance

                try:
                    balance = broadcast_balance(lambda: self._auto_balance(*args), self.timeout)
                except ValueError as exc:
                    raise PipelineConfigError(str(exc)) from exc
            else:
                balance = self._auto_balance(*args)
        specs = self._resolve_stages(stages, balance)
        S = len(specs)
        #: layer counts per stage when built from an nn.Sequential (decided by global rank 0
        #: and broadcast for balance="time"/"memory" under gloo/NCCL), else None
        self.balance: list[int] | None = None if balance is None else list(balance)
        if distributed:
            from engine.runtime.transport.layout import make_layout

            try:
                layout = make_layout(S, data_parallel)
            except ValueError as exc:
                raise PipelineConfigError(str(exc)) from None
            held = [layout.stage]
        else:
            held = list(range(S))
        modules = {s: self._build(specs[s], s) for s in held}
        self.device = torch.device("cpu")
        if transport == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            for m in modules.values():
                m.to(self.device)
        elif transport == "gloo":
            for s, m in modules.items():
                if any(p.is_cuda for p in m.parameters()):
                    raise PipelineConfigError(
                        f"stage {s} has CUDA parameters but transport='gloo' carries CPU tensors; "
                        "use transport='nccl' (one GPU per rank) or keep the model on CPU"
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
        for s, m in modules.items():
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

        # D_s by simulating the schedule the streams execute (engine.schedule.analysis; the
        # steady-state maximum, see docs/ALGORITHMS.md "Choices made by this implementation")
        self.delays = list(schedule_delays(schedule, S, M, k, order))
        for st in stage_objs:
            st.bridge.set_delay(self.delays[st.index])
            if lr_scheduler is not None:
                st.scheduler = lr_scheduler(st.optimizer)
        if distributed:
            from engine.runtime.distributed import RankRuntime
            from engine.runtime.transport.p2p import P2PTransport

            tp = P2PTransport(
                transport,
                layout.stage,
                list(layout.pipeline_ranks),
                layout.pipeline_group,
                self.device,
                self.timeout,
            )
            self._rank = RankRuntime(layout, tp, self.timeout)
            self.layout = layout
            stage_objs[0].grad_hook = self._rank.reduce_gradients
            self._executor = Executor(
                stage_objs, schedule, M, k, order, on_nonfinite, S=S, transport=tp
            )
        else:
            self.layout = None
            streams = self._make_streams(stage_objs, cuda_streams)
            self._executor = Executor(
                stage_objs, schedule, M, k, order, on_nonfinite, S=S, streams=streams
            )
        self._executor.scale = 1.0 / (M if schedule in SYNC_SCHEDULES else k)

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
    def _resolve_stages(stages: Any, balance: Any) -> list[StageSpec]:
        if isinstance(stages, nn.Sequential) and balance is not None:
            return list(_split_sequential(stages, balance))
        if balance is not None:
            raise PipelineConfigError("balance is only used with an nn.Sequential `stages`")
        if isinstance(stages, nn.Module):
            raise PipelineConfigError(
                "stages must be a list of nn.Module (one per stage), a list of factories "
                "() -> nn.Module, or an nn.Sequential with balance=[...]"
            )
        specs = list(stages)
        if not specs:
            raise PipelineConfigError("stages is empty; pass at least one nn.Module")
        for s, m in enumerate(specs):
            if not isinstance(m, nn.Module) and not callable(m):
                raise PipelineConfigError(
                    f"stage {s} is a {type(m).__name__}, not an nn.Module or a factory () -> nn.Module"
                )
        return specs

    @staticmethod
    def _build(spec: StageSpec, s: int) -> nn.Module:
        """The module of stage ``s``: the module itself, or what its factory returns."""
        m = spec
        if not isinstance(spec, nn.Module):
            m = spec()
            if not isinstance(m, nn.Module):
                raise PipelineConfigError(
                    f"the factory of stage {s} returned {type(m).__name__}; it must return an nn.Module"
                )
        assert isinstance(m, nn.Module)
        if isinstance(m, nn.Sequential) and len(m) == 0:
            raise PipelineConfigError(
                f"stage {s} is an empty nn.Sequential: more stages than layers; use fewer stages"
            )
        return m

    @staticmethod
    def _make_streams(stages: list[Stage], want: bool | None) -> dict[int, Any] | None:
        """One CUDA stream per stage when every stage lives on one CUDA device (local transport)."""
        devices = {p.device for st in stages for p in st.store.params}
        on_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
        if want is None:
            want = on_cuda and len(stages) > 1
        if not want:
            return None
        if not on_cuda:
            raise PipelineConfigError(
                "cuda_streams=True needs every stage's parameters on one CUDA device, found "
                f"{sorted(map(str, devices))}; move the stages with .cuda() or pass cuda_streams=False"
            )
        device = next(iter(devices))
        return {st.index: torch.cuda.Stream(device=device) for st in stages}

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

    def step(self, inputs: Tensor | None, targets: Any) -> Tensor:
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

        Under gloo/NCCL every rank calls ``step``; ``inputs`` are read on stage 0 and
        ``targets`` on the last stage (pass None elsewhere). A non-finite loss is detected at
        the end of the step on every rank: synchronous schedules then roll back or skip exactly
        as above; asynchronous ones raise on every rank, and the gradient of that micro-batch
        has already reached some updates (reload a checkpoint).
        """
        if self.distributed:
            return self._step_distributed(inputs, targets)
        assert inputs is not None
        xs, ts, sizes = self._split(inputs, targets)
        self._validate_shapes(xs[0], ts[0])
        ex = self._executor
        if self.is_sync:
            B = sum(sizes)
            scales = [b / B for b in sizes]
            ex.open_segment()
            ex.draining = True
            ex.N = self.M
            ex.feed(list(xs), ts, scales, sizes)
            try:
                ex.run()
                if ex.defer_nonfinite:
                    self._raise_deferred(ex.check_losses())
            except BaseException:
                ex.join_streams()
                ex.abort()
                raise
            skip = bool(ex.nonfinite)
            for st in self.stages:
                if skip:
                    st.discard_gradients()
                else:
                    ex.update_stage(st)
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
        ex.feed(list(xs), ts, [1.0 / self.k] * len(xs), sizes)
        self.steps += 1
        ex.run()
        loss, _ = ex.take_losses()
        return loss if loss is not None else torch.tensor(float("nan"))

    def _raise_deferred(self, bad: list[int]) -> None:
        """The sync step's non-finite check done after the run (CUDA streams, gloo/NCCL)."""
        if bad and self.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"micro-batch(es) {bad} gave a non-finite loss; the step was rolled back: no "
                "weight or optimizer state changed. Lower the learning rate, check the inputs, "
                "or pass on_nonfinite='skip'."
            )

    def _split_distributed(
        self, inputs: Tensor | None, targets: Any
    ) -> tuple[list[Tensor | None], list[Any], list[int]]:
        """Split what this rank reads: inputs on stage 0, targets on the last stage."""
        lay = self.layout
        first, last = lay.stage == 0, lay.stage == lay.stages - 1
        if self.device.type == "cuda":  # NCCL: the data a rank reads goes to its GPU
            if isinstance(inputs, Tensor):
                inputs = inputs.to(self.device, non_blocking=True)
            if isinstance(targets, Tensor):
                targets = targets.to(self.device, non_blocking=True)
        if first and not isinstance(inputs, Tensor):
            raise PipelineInputError(
                f"rank {lay.rank} runs stage 0 and needs the inputs: pass a tensor with the batch "
                f"on dim 0, got {type(inputs).__name__}"
            )
        if first:
            xs, ts, sizes = self._split(inputs, targets if last else None)
            return list(xs), ts if last else [None] * self.M, sizes
        if last:
            ref = targets if isinstance(targets, Tensor) else inputs
            if not isinstance(ref, Tensor):
                raise PipelineInputError(
                    f"rank {lay.rank} runs the last stage and needs the targets (a tensor with the "
                    "batch on dim 0) to compute the loss"
                )
            _, ts, sizes = self._split(ref, targets)
            return [None] * self.M, ts, sizes
        return [None] * self.M, [None] * self.M, [1] * self.M

    def _step_distributed(self, inputs: Tensor | None, targets: Any) -> Tensor:
        ex = self._executor
        rk = self._rank
        xs, ts, sizes = self._split_distributed(inputs, targets)
        if not rk.handshaken:
            rk.handshake(self.stages[0].module, xs[0], ts[0], self.stages[0].loss_fn)
        scale = 1.0 / (self.M if self.is_sync else self.k)
        rk.expect_loss()
        if self.is_sync:
            ex.open_segment()
            ex.draining = True
            ex.N = self.M
            ex.feed(xs, ts, [scale] * self.M, sizes)
            ex.run()
            rk.transport.wait_sends()
            bad = ex.check_losses()
            loss, _ = ex.take_losses()
            loss, nonfinite = rk.share_loss(loss, len(bad))
            if nonfinite and self.on_nonfinite == "raise":
                ex.abort()
                raise NonFiniteLossError(
                    f"{nonfinite} micro-batch(es) of this step gave a non-finite loss (seen by the last "
                    "stage); the step was rolled back on every rank: no weight or optimizer state "
                    "changed. Lower the learning rate, check the inputs, or pass on_nonfinite='skip'."
                )
            for st in self.stages:
                if nonfinite:
                    st.discard_gradients()
                else:
                    ex.update_stage(st)
            ex.close_segment()
            self.steps += 1
            self.skipped_steps += int(nonfinite > 0)
            assert loss is not None
            return loss
        if not ex.active:
            ex.open_segment()
        ex.feed(xs, ts, [scale] * self.M, sizes)
        self.steps += 1
        ex.run()
        bad = ex.check_losses()
        loss, _ = ex.take_losses()
        loss, nonfinite = rk.share_loss(loss, len(bad))
        if nonfinite:
            raise NonFiniteLossError(
                f"{nonfinite} micro-batch(es) gave a non-finite loss at the last stage of an "
                f"asynchronous {self.schedule!r} pipeline under transport={self.transport!r}; "
                "their gradients were not dropped (that needs every stage in one process) and "
                "already entered updates. Reload the last checkpoint and lower the learning rate."
            )
        return loss if loss is not None else torch.tensor(float("nan"))

    def flush(self) -> Tensor | None:
        """Drain an asynchronous pipeline: finish every backward and apply every pending
        gradient (a partial update group is applied as the mean over what arrived). Returns the
        mean loss of micro-batches whose forward completed during the flush (None if none).
        After a flush the next step() refills the pipeline from empty. A no-op for sync.
        Under gloo/NCCL every rank must call it (it ends with every send delivered)."""
        ex = self._executor
        if self.is_sync or not ex.active:
            return None
        ex.draining = True
        ex.N = ex.fed
        ex.run()
        if self.distributed:
            self._rank.transport.wait_sends()
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

        Per-stage lists cover the stages this process holds (``stage_indices``: all of them
        locally, this rank's one under gloo/NCCL, where the bubble fractions are None because a
        rank's clock sees only its own stage; measure throughput instead, see bench/).
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
            "bubble_fraction": None if self.distributed else ex.unit_clock.bubble(),
            "bubble_fraction_wall": None if self.distributed else ex.wall_clock.bubble(),
            "transport": self.transport,
            "stage_indices": [st.index for st in self.stages],
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
        self._require_local("state_dict()")
        from engine.checkpoint import pipeline_state_dict

        return pipeline_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output; validated completely before anything changes."""
        self._require_local("load_state_dict()")
        from engine.checkpoint import load_pipeline_state_dict

        load_pipeline_state_dict(self, state)

    def _require_local(self, what: str) -> None:
        if self.distributed:
            raise PipelineConfigError(
                f"{what} of a transport={self.transport!r} pipeline: each rank holds only its stage "
                f"(stage {self.layout.stage}), and the whole-pipeline checkpoint format needs all "
                "of them in one process. Save per rank with "
                "torch.save(pipe.stages[0].module.state_dict(), f'stage{pipe.layout.stage}.pt') "
                "after pipe.flush(), or train with transport='local' to use engine.save."
            )

    def __repr__(self) -> str:
        return (
            f"Pipeline(schedule={self.schedule!r}, stages={self.S}, chunks={self.M}, update_size={self.k}, "
            f"delays={self.delays}, checkpoint={self.checkpoint!r}, transport={self.transport!r})"
        )
