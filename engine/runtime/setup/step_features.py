"""The training features layered on a pipeline's step: clipping, mixed precision, offload.

Why a module: ``Pipeline(clip_grad_norm=..., autocast=..., offload_activations=...)`` are
options of *how a step trains*, independent of the schedule and transport. They are validated
here, before any weight exists (:func:`check_step_features`), and attached to the built stages
and executor in one place (:func:`attach`), for the local and the multi-process runtime alike.
The concepts live in their own modules, their checks and attachment included:
:mod:`~engine.runtime.exec.clipping`, :mod:`~engine.runtime.precision`,
:mod:`~engine.runtime.stage.offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import PipelineConfigError
from engine.runtime.exec.clipping import GradClipper, check_clip_options
from engine.runtime.precision import attach_precision, check_precision

__all__ = ["StepFeatures", "check_step_features", "attach"]


@dataclass(frozen=True)
class StepFeatures:
    """Validated options (see ``Pipeline``)."""

    clip_grad_norm: float | None = None
    clip_norm_type: float = 2.0
    autocast: torch.dtype | None = None
    grad_scaler: dict[str, Any] = field(default_factory=dict)
    offload_activations: bool = False

    def describe(self) -> dict[str, Any]:
        """What every rank must agree on (engine.runtime.ranks.agreement)."""
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
    scaler = check_precision(autocast, grad_scaler)
    if not isinstance(offload_activations, bool):
        raise PipelineConfigError(
            f"offload_activations={offload_activations!r} must be True or False"
        )
    return StepFeatures(max_norm, norm_type, autocast, scaler, offload_activations)  # type: ignore[arg-type]


def attach(
    feats: StepFeatures, ex: Any, stages: list[Any], spec: Any, device: torch.device,
    ties: Any = None, group: Any = None,
) -> None:
    """Attach the features to the built ``stages`` and their executor ``ex`` (at the end of
    the build; under gloo/NCCL with the pipeline's process ``group``, after the rank executor
    exists). ``device``: the pipeline's; ``ties``: its tie groups (clipping counts a tie once)."""
    clipper = None
    if feats.clip_grad_norm is not None:
        clipper = GradClipper(
            feats.clip_grad_norm, feats.clip_norm_type, stages, spec.synchronous, ties,
        )
        if group is not None:
            clipper.connect(group, spec.stages, device)
    ex.clipper = clipper
    for st in stages:
        st.clipper = clipper
    if feats.offload_activations:
        _attach_offload(stages, spec, device)
    if feats.autocast is not None:
        attach_precision(feats.autocast, feats.grad_scaler, ex, stages, spec, device, group)


def _attach_offload(stages: list[Any], spec: Any, device: torch.device) -> None:
    from engine.runtime.stage.offload import ActivationOffload

    for st in stages:
        if st.remaps_saved:
            raise PipelineConfigError(
                f"offload_activations with {spec.describe()}: stage {st.index}'s backward "
                "re-points the weights its forward saved at another buffer (weight prediction "
                "or PipeMare T2 without recomputation), through saved-tensor hooks that "
                "offload would replace. Use checkpoint='always' for those stages (nothing to "
                "offload then) or drop offload_activations."
            )
    for st in stages:
        st.offload = ActivationOffload(st.module, pin=device.type == "cuda")
