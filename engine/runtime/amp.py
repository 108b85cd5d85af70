"""Mixed precision for a pipeline: autocast per stage and dynamic loss scaling across stages.

Filled in below; this part validates the options.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import PipelineConfigError

__all__ = ["check_grad_scaler", "SCALER_DEFAULTS"]

#: torch.amp.GradScaler's defaults
SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}


def check_grad_scaler(options: Any, autocast: torch.dtype | None) -> dict[str, Any]:
    """The loss scaler's options (GradScaler's keywords) for ``autocast=torch.float16``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise PipelineConfigError(
            f"grad_scaler={options!r} must be a dict of torch.amp.GradScaler keywords "
            f"({', '.join(SCALER_DEFAULTS)}) or None"
        )
    unknown = sorted(set(options) - set(SCALER_DEFAULTS))
    if unknown:
        raise PipelineConfigError(
            f"grad_scaler: unknown option(s) {unknown}; known: {sorted(SCALER_DEFAULTS)}"
        )
    if options and autocast is not torch.float16:
        raise PipelineConfigError(
            "grad_scaler options apply to dynamic loss scaling, which runs with "
            f"autocast=torch.float16 only (got autocast={autocast!r})"
        )
    merged = {**SCALER_DEFAULTS, **options}
    for k in ("init_scale", "growth_factor"):
        v = merged[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > (1.0 if k == "growth_factor" else 0.0):
            raise PipelineConfigError(f"grad_scaler[{k!r}]={v!r} must be a number > {1 if k == 'growth_factor' else 0}")
    b = merged["backoff_factor"]
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b < 1.0:
        raise PipelineConfigError(f"grad_scaler['backoff_factor']={b!r} must lie in (0, 1)")
    gi = merged["growth_interval"]
    if isinstance(gi, bool) or not isinstance(gi, int) or gi < 1:
        raise PipelineConfigError(f"grad_scaler['growth_interval']={gi!r} must be an int >= 1")
    return merged if autocast is torch.float16 else {}
