"""``Pipeline(schedule="auto")``: measure or read the stage costs, then let the chooser pick.

Why here and not in the schedule package: the chooser (:mod:`engine.schedule.auto`) is
torch-free and works on numbers; turning the user's stages into those numbers needs the
modules -- the partitioner's profiler times each stage and counts the bytes autograd saves
(:func:`engine.partition.profile_layers`), or a profile file declares them -- and the
partitioner's memory formula (weights, gradient, optimizer state at ``optimizer_state_factor``
2, the Adam-sized upper bound it uses too, and buffers). The choice is made once, before
anything is built, and the pipeline then runs the chosen family as if it had been named.

A profile file (``balance_profile``) is read when it exists (checked against the stages) and
written after measuring otherwise, so a rerun or a resumed run chooses from the same numbers.
Under gloo/NCCL every process would time its stages differently and could choose another
family; those transports take a family chosen beforehand (``engine.schedule.auto`` on
declared costs).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from engine.errors import PipelineConfigError
from engine.schedule.auto import Choice, StageCosts, choose_schedule

__all__ = ["choose_for_pipeline", "stage_costs_of"]

#: optimizer buffers per parameter assumed for the fixed bytes (Adam's 2, as the partitioner)
OPTIMIZER_STATE_FACTOR = 2


def stage_costs_of(layer_costs: Sequence[Any], balance: Sequence[int] | None) -> list[StageCosts]:
    """Per-stage costs from the partitioner's per-layer ones (summed over each stage's layers
    when ``balance`` is given, else one layer per stage)."""
    counts = list(balance) if balance is not None else [1] * len(layer_costs)
    out, i = [], 0
    for n in counts:
        layers = layer_costs[i : i + n]
        i += n
        params = sum(c.param_bytes for c in layers)
        fixed = 2 * params + math.ceil(params * OPTIMIZER_STATE_FACTOR) + sum(
            c.buffer_bytes for c in layers
        )
        out.append(StageCosts(
            forward=sum(c.forward_time for c in layers),
            backward=sum(c.backward_time for c in layers),
            activation_bytes=sum(c.activation_bytes for c in layers),
            fixed_bytes=fixed,
            param_bytes=params,
        ))
    return out


def _refuse(what: str) -> PipelineConfigError:
    return PipelineConfigError(f"schedule='auto' {what}")


def choose_for_pipeline(
    stages: Any,
    chooser: str,
    *,
    chunks: int | None,
    memory_cap_bytes: float | None,
    balance: Any,
    sample: Tensor | None,
    profile: str | os.PathLike[str] | None,
    repeats: int,
    distributed: bool,
    given: dict[str, Any],
) -> Choice:
    """The choice for a pipeline's arguments (module docstring); a PipelineConfigError naming
    the option otherwise. ``given``: the options the chooser decides, which must be unset."""
    set_ = [f"{k}={v!r}" for k, v in given.items() if v is not None]
    if set_:
        raise _refuse(f"chooses {', '.join(given)} itself; leave {', '.join(set_)} unset")
    if distributed:
        raise _refuse(
            "profiles the stages in one process; under gloo/NCCL each process would measure "
            "different times and could choose another family. Choose beforehand with "
            "engine.schedule.auto.choose_schedule on declared costs and pass the family"
        )
    if chunks is None:
        raise _refuse("needs chunks=M (micro-batches per step): the memory depends on it")
    if isinstance(balance, str):
        raise _refuse(
            f"with balance={balance!r}: the split depends on the schedule and the schedule on "
            "the split; pass layer counts (balance=[...]) or a list of stage modules"
        )
    if isinstance(stages, nn.Sequential):
        if balance is None:
            raise _refuse("with an nn.Sequential needs balance=[layer counts per stage]")
        model, counts = stages, list(balance)
    elif isinstance(stages, Sequence) and stages and all(isinstance(m, nn.Module) for m in stages):
        model, counts = nn.Sequential(*stages), None
    else:
        raise _refuse(
            "needs the stage modules (a list of nn.Module, or an nn.Sequential with balance) "
            "to profile; factories are built one per process"
        )
    from engine.partition import load_profile, profile_layers, save_profile

    try:
        if profile is not None and os.path.exists(profile):
            layer_costs = load_profile(model, profile)
        else:
            if sample is None:
                raise _refuse(
                    "needs the stage costs: pass sample=<one micro-batch of inputs> to profile "
                    "the stages, or balance_profile=<a saved profile file> to declare them"
                )
            layer_costs = profile_layers(model, sample, repeats=repeats)
            if profile is not None:
                dev = str(next(model.parameters(), sample).device)
                save_profile(layer_costs, model, profile, repeats=repeats, device=dev)
        costs = stage_costs_of(layer_costs, counts)
        return choose_schedule(
            costs, chunks=chunks, memory_cap_bytes=memory_cap_bytes,
            asynchronous=chooser == "auto-async",
        )
    except PipelineConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise PipelineConfigError(f"schedule={chooser!r}: {exc}") from exc
