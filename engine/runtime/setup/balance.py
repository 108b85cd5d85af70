"""``balance="time"`` / ``"memory"``: partition an nn.Sequential automatically.

The layers are profiled on one micro-batch (``sample``) and split with the exact solver of
:mod:`engine.partition`, for the schedule's weight versions and activation counts. Under
gloo/NCCL global rank 0 decides and broadcasts (see :mod:`engine.runtime.ranks.rank`): timings
differ between processes, and every rank must cut at the same layers.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from engine.errors import PipelineConfigError

__all__ = ["auto_balance"]


def auto_balance(
    stages: Any,
    balance: str,
    schedule: Any,
    chunks: int | None,
    order: str | None,
    num_stages: int | None,
    sample: Tensor | None,
    cap: float | None,
    repeats: int = 3,
    profile: Any = None,
) -> list[int]:
    """Layer counts per stage for ``balance`` ("time" or "memory"); ``repeats`` timed runs
    per layer (median), ``profile`` a JSON file of layer costs to reuse or write."""
    if not isinstance(stages, nn.Sequential):
        raise PipelineConfigError(f"balance={balance!r} needs `stages` to be an nn.Sequential")
    if balance not in ("time", "memory"):  # before asking for what only profiling needs
        raise PipelineConfigError(
            f"unknown balance {balance!r}; use 'time', 'memory' or a list of layer counts"
        )
    if num_stages is None or sample is None:
        raise PipelineConfigError(
            f"balance={balance!r} profiles the model: also pass num_stages=S and sample=<one "
            "micro-batch of inputs>, e.g. Pipeline(seq, balance='time', num_stages=4, "
            "sample=x[:8], ...)"
        )
    if not isinstance(schedule, str):
        raise PipelineConfigError(
            f"balance={balance!r} needs a schedule family name to model the memory of each "
            "stage; with a schedule program, pass layer counts"
        )
    from engine.partition import balance_model

    try:
        return balance_model(
            stages,
            sample,
            num_stages,
            balance=balance,
            schedule=schedule,
            chunks=chunks if chunks is not None else 1,
            memory_cap_bytes=cap,
            order=order,
            repeats=repeats,
            profile=profile,
        )
    except (ValueError, TypeError) as exc:
        raise PipelineConfigError(f"automatic balance={balance!r} failed: {exc}") from exc
