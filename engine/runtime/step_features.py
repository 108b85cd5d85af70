"""The training features layered on a pipeline's step: clipping, mixed precision, offload.

Why a module: ``Pipeline(clip_grad_norm=..., autocast=..., offload_activations=...)`` are
options of *how a step trains*, independent of the schedule and transport. They are validated
here, before any weight exists (:func:`check_step_features`), and attached to the built stages
and executor in one place (:func:`attach`), for the local and the multi-process runtime alike.
The concepts live in their own modules: :mod:`~engine.runtime.clipping`,
:mod:`~engine.runtime.amp`, :mod:`~engine.runtime.offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import PipelineConfigError
from engine.runtime.amp import LossScaler
from engine.runtime.clipping import GradClipper, check_clip_options

if TYPE_CHECKING:
    from engine.runtime.pipeline import Pipeline

__all__ = ["StepFeatures", "check_step_features", "attach", "check_async_fp16"]

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StepFeatures:
    """Validated options (see ``Pipeline``)."""

    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    autocast: torch.dtype | None = None
    grad_scaler: dict[str, Any] = field(default_factory=dict)
    offload_activations: bool = False

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on (engine.runtime.agreement)."""
        return {
            "clip_grad_norm": self.clip_grad_norm,
            "clip_norm_type": self.clip_norm_type,
            "autocast": str(self.autocast),
            "grad_scaler": sorted(self.grad_scaler.items()),
            "offload_activations": self.offload_activations,
        }


def check_step_features(
    *,
    clip_grad_norm: object,
    clip_norm_type: object,
    autocast: object,
    grad_scaler: object,
    offload_activations: object,
) -> StepFeatures:
    max_norm, norm_type = check_clip_options(clip_grad_norm, clip_norm_type)
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise PipelineConfigError(
            f"autocast={autocast!r}: pass torch.bfloat16, torch.float16 or None (weights stay "
            "float32 in the arena; each stage's forward runs under torch.autocast)"
        )
    from engine.runtime.amp import check_grad_scaler

    scaler = check_grad_scaler(grad_scaler, autocast)  # type: ignore[arg-type]
    if not isinstance(offload_activations, bool):
        raise PipelineConfigError(
            f"offload_activations={offload_activations!r} must be True or False"
        )
    return StepFeatures(max_norm, norm_type, autocast, scaler, offload_activations)  # type: ignore[arg-type]


def attach(pipe: Pipeline, group: Any = None) -> None:
    """Attach the features to ``pipe``'s stages and executor (at the end of the build; under
    gloo/NCCL with the pipeline's process ``group``, after the rank executor exists)."""
    feats: StepFeatures = pipe.features
    ex = pipe._executor
    stages = pipe.stages
    clipper = None
    if feats.clip_grad_norm is not None:
        clipper = GradClipper(
            feats.clip_grad_norm, feats.clip_norm_type, stages, pipe.spec.synchronous,
            getattr(pipe, "ties", None),
        )
        if group is not None:
            clipper.connect(group, pipe.spec.stages, pipe.device)
    ex.clipper = clipper
    for st in stages:
        st.clipper = clipper
    if feats.offload_activations:
        _attach_offload(pipe)
    if feats.autocast is None:
        return
    device_type = pipe.device.type
    for st in stages:
        st.autocast = (feats.autocast, device_type)
    if feats.autocast is not torch.float16:
        return
    if not pipe.spec.synchronous:
        raise PipelineConfigError(_FP16_ASYNC.format(pipe.spec.describe()))
    scaler = LossScaler(feats.grad_scaler, pipe.device)
    scaler.group = group
    ex.loss_scaler = scaler
    for st in stages:
        st.loss_scaler = scaler
        if st.bridge is not None and st.bridge.is_engine:
            # GradScaler's protocol: the optimizer skips its whole update on the device
            st.bridge.opt.found_inf = scaler.found_inf


def _attach_offload(pipe: Pipeline) -> None:
    from engine.runtime.offload import ActivationOffload

    for st in pipe.stages:
        if st._saved is not None:
            raise PipelineConfigError(
                f"offload_activations with {pipe.spec.describe()}: stage {st.index}'s backward "
                "re-points the weights its forward saved at another buffer (weight prediction "
                "or PipeMare T2 without recomputation), through saved-tensor hooks that "
                "offload would replace. Use checkpoint='always' for those stages (nothing to "
                "offload then) or drop offload_activations."
            )
    for st in pipe.stages:
        st.offload = ActivationOffload(st.module, pin=pipe.device.type == "cuda")


_FP16_ASYNC = (
    "autocast=torch.float16 with {}: dynamic loss scaling decides one skip per synchronous "
    "step; an asynchronous schedule's micro-batches would need the scale their backward ran "
    "with carried to every stage's update, which the engine does not do yet. Use "
    "autocast=torch.bfloat16 (no loss scaling needed) or a synchronous schedule."
)


def check_async_fp16(autocast: Any, synchronous_hint: bool | None, schedule: Any) -> None:
    """Refuse float16 on an asynchronous family before anything is built."""
    if autocast is torch.float16 and synchronous_hint is False:
        raise PipelineConfigError(_FP16_ASYNC.format(f"schedule={schedule!r}"))
