"""Pipeline options: validated once, before any weight exists, into one frozen config.

Why a module: ``Pipeline(...)`` takes many keywords, and every invalid value or combination
must fail here with a message naming the option and the fix -- not later inside a step. The
schedule itself is resolved by :func:`engine.schedule.spec.resolve_schedule`; the weight
mitigations are resolved against the stage optimizers once they exist
(:func:`resolve_mitigations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine._deprecation import deprecated
from engine.errors import PipelineConfigError
from engine.mitigations import WEIGHT_PREDICTIONS
from engine.runtime.setup.l2 import check_l2_option
from engine.schedule.catalog import live_async
from engine.schedule.spec import ScheduleSpec

__all__ = [
    "CHECKPOINT_MODES",
    "DEFAULT_CHECKPOINT",
    "WEIGHT_PREDICTIONS",
    "TRANSPORTS",
    "PipelineConfig",
    "check_options",
    "resolve_mitigations",
]

CHECKPOINT_MODES = ("never", "except_last", "always")
#: Activation recomputation by default: none. Recomputing trades step time for activation
#: memory (README, "Activation recomputation", has the measurements): recompute where the
#: activations do not fit. The CLI's ``--recompute`` default is this same constant.
DEFAULT_CHECKPOINT = "never"
TRANSPORTS = ("local", "gloo", "nccl")
NONFINITE = ("raise", "skip", "skip_update")
#: how a multi-process pipeline learns each activation's shapes (NCCL: transport/nccl.py)
ACTIVATION_SHAPES = ("inputs", "any")


@dataclass(frozen=True)
class PipelineConfig:
    """The validated options that do not depend on the stages (see ``Pipeline``)."""

    transport: str
    checkpoint: str
    on_nonfinite: str
    data_parallel: int
    timeout: float
    cuda_streams: bool | None
    trace: bool
    correction_decay: float
    l2_persistence: float = 0.0  # fraction of the device's persisting L2; 0: off
    #: False, "optimizer" (each stage's optimizer step, engine.runtime.capture.optimizer_graphs; True means
    #: this) or "program" (whole synchronous steps, engine.runtime.capture.synchronous)
    cuda_graphs: bool | str = False
    #: "inputs": activation shapes follow from the first stage's input shapes; "any": they
    #: may depend on the data (NCCL then sends each activation's shapes on the control plane)
    activation_shapes: str = "inputs"

    @property
    def distributed(self) -> bool:
        return self.transport != "local"

    def recompute(self, stage: int, num_stages: int) -> bool:
        """Whether ``stage`` recomputes its forward in the backward."""
        if self.checkpoint == "always":
            return True
        return self.checkpoint == "except_last" and stage < num_stages - 1


def _choice(name: str, value: object, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise PipelineConfigError(
            f"{name}={value!r} is not valid; {what}: {', '.join(repr(c) for c in choices)}"
        )
    assert isinstance(value, str)
    return value


def check_options(
    *,
    transport: object,
    checkpoint: object,
    on_nonfinite: object,
    data_parallel: object,
    timeout: object,
    cuda_streams: object,
    trace: object,
    correction_decay: object,
    loss_fn: object,
    optimizer: object,
    lr_scheduler: object,
    synchronous_hint: bool | None,
    schedule_name: str = "",
    l2_persistence: object = False,
    cuda_graphs: object = False,
    mesh: object = None,
    activation_shapes: object = "inputs",
) -> PipelineConfig:
    """Validate the stage-independent options (``synchronous_hint``: whether the schedule
    name is a synchronous family, None when not known yet)."""
    if transport not in TRANSPORTS:
        raise PipelineConfigError(
            f"transport={transport!r} is not available; use 'local' (one process, exact "
            "simulation of every schedule), 'gloo' (CPU, one process per stage) or 'nccl' "
            "(GPU, one process per stage)"
        )
    _choice("checkpoint", checkpoint, CHECKPOINT_MODES, "activation recomputation is one of")
    _choice("activation_shapes", activation_shapes, ACTIVATION_SHAPES,
            "choose 'inputs' (shapes follow from the first stage's input shapes) or 'any' "
            "(shapes may depend on the data)")
    _choice("on_nonfinite", on_nonfinite, NONFINITE, "choose")
    if not isinstance(data_parallel, int) or isinstance(data_parallel, bool) or data_parallel < 1:
        raise PipelineConfigError(f"data_parallel={data_parallel!r} must be an int >= 1")
    distributed = transport != "local"
    if mesh is not None:  # tensor parallelism: the mesh says the replicas (runtime/ranks/mesh.py)
        from engine.runtime.setup.mesh_option import check_mesh

        data_parallel = check_mesh(mesh, transport, data_parallel)["dp"]
    if data_parallel > 1 and not distributed:
        raise PipelineConfigError(
            f"data_parallel={data_parallel} needs one process per (replica, stage): use "
            "transport='gloo' or 'nccl' under torchrun"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise PipelineConfigError(f"timeout={timeout!r} must be a positive number of seconds")
    if distributed and on_nonfinite == "skip" and synchronous_hint is False:
        raise PipelineConfigError(
            f"on_nonfinite='skip' with schedule={schedule_name!r} and transport={transport!r}: "
            "dropping one micro-batch at every stage of an asynchronous pipeline needs all "
            "stages in one process. Use on_nonfinite='skip_update' (engine.optim optimizers: "
            "the update that holds it is skipped on every rank), 'raise' (every rank raises at "
            "the end of the step) or transport='local'."
        )
    if cuda_streams not in (None, True, False):
        raise PipelineConfigError(f"cuda_streams={cuda_streams!r} must be None, True or False")
    if cuda_streams and distributed:
        raise PipelineConfigError(
            "cuda_streams is for the local transport; under NCCL each rank has one compute "
            "stream, and NCCL's own stream overlaps the transfers with it"
        )
    if not isinstance(trace, bool):
        raise PipelineConfigError(f"trace={trace!r} must be True or False")
    if cuda_graphs is True:
        cuda_graphs = "optimizer"
    if cuda_graphs is not False and not (isinstance(cuda_graphs, str)
                                         and cuda_graphs in ("optimizer", "program")):
        raise PipelineConfigError(
            f"cuda_graphs={cuda_graphs!r} must be False (off), 'optimizer' (each stage's "
            "optimizer step; True means this) or 'program' (whole synchronous steps)"
        )
    if cuda_graphs == "program" and cuda_streams is None:
        cuda_streams = False  # a captured step runs on one stream (not the default streams)
    if cuda_graphs == "program" and distributed:
        raise PipelineConfigError(
            f"cuda_graphs='program' with transport={transport!r}: only the local transport is "
            "captured (a graph cannot hold gloo/NCCL messages yet); use cuda_graphs='optimizer'"
        )
    l2_fraction = check_l2_option(l2_persistence)
    if l2_fraction and distributed:
        raise PipelineConfigError(
            f"l2_persistence with transport={transport!r}: the runtime sets L2 windows on the "
            "local transport's stage streams only; under gloo/NCCL call "
            "WeightArena.set_l2_persistence on the rank's stream yourself, or drop the option"
        )
    if l2_fraction and cuda_streams is False:
        raise PipelineConfigError(
            "l2_persistence sets each stage's L2 window on its own stage stream, and "
            "cuda_streams=False turns those off; pass cuda_streams=None (or True)"
        )
    if (
        isinstance(correction_decay, bool)
        or not isinstance(correction_decay, (int, float))
        or not 0.0 < correction_decay < 1.0
    ):
        raise PipelineConfigError(
            f"correction_decay={correction_decay!r} must lie in (0, 1) (PipeMare's D_decay)"
        )
    for name, fn in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if not callable(fn):
            raise PipelineConfigError(
                f"{name} must be callable, got {type(fn).__name__}"
                + (
                    "; pass a factory, e.g. optimizer=lambda params: engine.optim.SGD(params, lr=0.1)"
                    if name == "optimizer"
                    else ""
                )
            )
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise PipelineConfigError(
            "lr_scheduler must be a callable optimizer -> scheduler, e.g. "
            "lambda opt: engine.optim.PipeMareLR(opt, 100)"
        )
    return PipelineConfig(
        transport=str(transport),
        checkpoint=str(checkpoint),
        on_nonfinite=str(on_nonfinite),
        data_parallel=int(data_parallel),
        timeout=float(timeout),
        cuda_streams=cuda_streams,  # type: ignore[arg-type]
        trace=bool(trace),
        correction_decay=float(correction_decay),
        l2_persistence=l2_fraction,
        cuda_graphs=cuda_graphs,
        activation_shapes=str(activation_shapes),
    )


def resolve_mitigations(
    spec: ScheduleSpec,
    bridges: list[Any],
    weight_prediction: str | None,
    discrepancy_correction: bool | None,
) -> tuple[str | None, bool]:
    """(weight prediction, discrepancy correction) for ``spec`` given the stage optimizers
    (their ``bridge``). The pipeline's options are the switches (docs/DESIGN.md, "One switch
    per mitigation"): they choose which weights F and B read, and the builder then asks each
    stage optimizer for what that needs (an engine optimizer's ``prediction`` and
    ``discrepancy_correction`` group options, or the runtime's own computation for a plain
    torch.optim one). An engine optimizer built with ``prediction`` or
    ``discrepancy_correction`` and no pipeline option still switches the mitigation on, the
    deprecated spelling."""
    if weight_prediction is not None and weight_prediction not in WEIGHT_PREDICTIONS:
        raise PipelineConfigError(
            f"weight_prediction={weight_prediction!r}; choose None or one of "
            f"{', '.join(WEIGHT_PREDICTIONS)}"
        )
    opt_prediction = None
    opt_correction = False
    for s, bridge in enumerate(bridges):
        if bridge is None or bridge.opt is None:
            continue
        try:
            pmode = bridge.group_option("prediction")
            corr = bridge.group_option("discrepancy_correction")
        except ValueError as exc:
            raise PipelineConfigError(f"stage {s}: {exc}") from None
        opt_prediction = opt_prediction or pmode
        opt_correction = opt_correction or bool(corr)
    mitigable = live_async(spec.weights, spec.synchronous)
    if weight_prediction is None and opt_prediction is not None and mitigable:
        deprecated(f"switching weight prediction on with the stage optimizer's "
                   f"prediction={opt_prediction!r} alone", "Pipeline(weight_prediction='lwp')")
        weight_prediction = "lwp"
    if (weight_prediction is not None or opt_prediction is not None) and not mitigable:
        why = "has no delay" if spec.synchronous else "already uses stashed weights"
        raise PipelineConfigError(
            "weight prediction (LWP/SpecTrain) mitigates the live-weight staleness of "
            f"asynchronous schedules such as 'pb'; {spec.describe()} {why}. Use schedule='pb' "
            "or drop the prediction option (pipeline and optimizer)."
        )
    if weight_prediction in ("spectrain", "spectrain_reuse") and opt_prediction == "momentum":
        raise PipelineConfigError(
            f"weight_prediction={weight_prediction!r} is SpecTrain's linear extrapolation "
            "(s * lr * v); the stage optimizers use prediction='momentum'. Build them with "
            "prediction='linear', or use weight_prediction='lwp' to keep the momentum form."
        )
    if discrepancy_correction is None and opt_correction and mitigable:
        deprecated("switching discrepancy correction on with the stage optimizer's "
                   "discrepancy_correction=True alone", "Pipeline(discrepancy_correction=True)")
    correction = opt_correction if discrepancy_correction is None else bool(discrepancy_correction)
    if correction and not mitigable:
        raise PipelineConfigError(
            "discrepancy_correction (PipeMare T2) corrects the live weights of asynchronous "
            f"schedules such as 'pb'; it is invalid with {spec.describe()}"
        )
    if correction and weight_prediction is not None:
        raise PipelineConfigError(
            "combine at most one backward-weight mitigation: discrepancy_correction (PipeMare "
            f"T2) and weight_prediction={weight_prediction!r} both redefine the weights B reads"
        )
    _check_delay_compensation(spec, bridges, correction)
    return weight_prediction, correction


def _check_delay_compensation(spec: ScheduleSpec, bridges: list[Any], correction: bool) -> None:
    """Delay compensation (ALGORITHMS.md) corrects a gradient computed at w_(t-tau) towards
    w_t: it needs weights that lag, i.e. stashed versions (pipedream, 2bw) or, under live
    weights (pb), PipeMare T2's backward weights w_t - tau_s * delta, whose lag it removes."""
    for s, bridge in enumerate(bridges):
        if bridge is None or bridge.opt is None or not bridge.is_engine:
            continue
        if spec.synchronous and any(g.get("spike_compensation") for g in bridge.opt.param_groups):
            raise PipelineConfigError(
                f"stage {s}: spike_compensation=True compensates the delay of an asynchronous "
                f"schedule, but {spec.describe()} has no delay (it would do nothing); use an "
                "asynchronous schedule or set it to False"
            )
        # groups may differ (e.g. no DC for embeddings): any group with it needs a lag
        lam = next((g["delay_compensation"] for g in bridge.opt.param_groups
                    if g.get("delay_compensation")), 0.0)
        if not lam:
            continue
        if spec.synchronous:
            raise PipelineConfigError(
                f"stage {s}: delay_compensation={lam!r} compensates delayed gradients, but "
                f"{spec.describe()} has no delay; use an asynchronous schedule or set it to 0"
            )
        if spec.weights == "live" and not correction:
            raise PipelineConfigError(
                f"stage {s}: delay_compensation={lam!r} under {spec.describe()} needs "
                "discrepancy_correction=True: with live weights the backward reads w_t, and "
                "only PipeMare T2's w_t - tau_s * delta gives the gradient the lag "
                "tau_s * delta that the compensation removes"
            )
