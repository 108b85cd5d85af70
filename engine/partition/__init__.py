"""Automatic partitioning: profile the layers of an ``nn.Sequential``, then split it into
pipeline stages that are as fast (``balance="time"``) or as small (``balance="memory"``) as
possible while every stage fits a memory cap.

Why this module exists, and why it looks the way it does:

* A pipeline runs at the speed of its slowest stage, and a hand-typed ``balance=[...]`` is
  easily unbalanced or over a device's memory. Profiling each layer once and solving the
  split exactly takes well under a second for hundreds of layers and removes the guesswork.
* What a stage holds depends on the **schedule** and on the stage's **position**: PipeDream
  stashes S-s weight versions at stage s, 2BW keeps two, GPipe keeps the activations of all M
  micro-batches while 1F1B keeps at most S-s, and pipelined backprop (dataflow order) keeps
  2(S-1-s)+1. A partitioner that ignores this puts too many layers on stage 0 and runs out of
  memory exactly where it matters. :func:`stage_footprint` gives these counts; they are the
  steady-state values of ALGORITHMS.md, and ``tests/test_partition.py`` checks them against
  :func:`engine.schedule.analyze`, which measures them by simulating the generated schedules.
  For the asynchronous schedules (pipedream, 2bw, pb) the pipeline stays full across
  mini-batches, so the count does not shrink with small M (PipeDream keeps S-s micro-batches
  and versions in flight even with M = 1); the synchronous ones flush every mini-batch, so
  1F1B holds min(M, S-s) and GPipe M.
* The solver is exact, not greedy (see :func:`partition`): dynamic programming over prefix
  sums, O(S * n^2) for n layers and S stages. Times are converted to exact integers (every
  float is a dyadic rational, so scaling by the largest denominator is lossless) and memory is
  counted in whole bytes, so comparisons never depend on floating-point summation order, and
  a brute force over all splits finds exactly the same answer (the tests check this).

Memory of stage s holding layers i..j-1 (``P`` parameter bytes, ``Buf`` buffer bytes, ``A``
activation bytes of one micro-batch, all summed over the layers)::

    memory = P * (versions_s + 1 gradient) + ceil(P * optimizer_state_factor) + Buf
             + A * activations_s

``optimizer_state_factor`` counts optimizer buffers per parameter element of the same dtype:
0 for plain SGD, 1 for SGD with momentum, 2 for Adam/AdamW (the default: a safe upper bound);
add 1 for PipeMare's discrepancy-correction delta or a materialised weight prediction.
Activation bytes per layer are the tensors autograd saves for backward (parameters excluded,
shared storage counted once) plus the layer's output; summing them over a stage is an upper
bound (a layer's output is often also what the next layer saves), which is the safe side
for a cap.

Tie-break (deterministic): among the splits that minimise the objective, take the one that
minimises the other quantity's maximum (``"time"``: the least peak stage memory;
``"memory"``: the least bottleneck time); among those, the lexicographically smallest balance,
i.e. the fewest layers on the earliest stages, which under 1F1B/PipeDream/pb are the stages
that hold the most versions and activations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine._checks import check_positive_int
from engine.partition.costs import (
    OPTIMIZER_STATE_FACTORS,
    LayerCost,
    StageCost,
    _check_balance,
    _optimizer_factor,
    stage_costs,
)
from engine.partition.footprint import SCHEDULES, stage_footprint
from engine.partition.profile import profile_layers
from engine.partition.solver import OBJECTIVES, _check_cap, partition

__all__ = [
    "OBJECTIVES",
    "OPTIMIZER_STATE_FACTORS",
    "SCHEDULES",
    "LayerCost",
    "StageCost",
    "balance_model",
    "partition",
    "profile_layers",
    "split_sequential",
    "stage_costs",
    "stage_footprint",
]


# ----------------------------------------------------------------------------- model level


def split_sequential(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into ``len(balance)`` consecutive ``nn.Sequential`` stages.

    The stages share the original modules (no copies) and keep their names, so a stage's
    ``state_dict`` keys are the model's (``"3.weight"`` stays ``"3.weight"``).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    bal = _check_balance(balance, len(model), what="layers")
    children = list(model.named_children())
    out, i = [], 0
    for n in bal:
        out.append(nn.Sequential(OrderedDict(children[i : i + n])))
        i += n
    return out


def balance_model(
    model: nn.Sequential,
    sample: Tensor,
    stages: int,
    *,
    balance: str | Sequence[int] = "time",
    schedule: str,
    chunks: int,
    memory_cap_bytes: float | None = None,
    optimizer_state_factor: float | str = 2,
    order: str | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
) -> list[int]:
    """Profile ``model`` on ``sample`` (one micro-batch) and return the optimal balance.

    ``balance="time"`` or ``"memory"`` picks the objective (see :func:`partition`); a list is
    validated against the model and returned unchanged.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"balance_model needs an nn.Sequential, got {type(model).__name__}")
    if not isinstance(balance, str):
        bal = _check_balance(balance, len(model), what="layers")
        if len(bal) != stages:
            raise ValueError(f"balance {bal} has {len(bal)} stages but stages={stages}")
        return bal
    if balance not in OBJECTIVES:
        raise ValueError(
            f"unknown balance {balance!r}; use 'time', 'memory' or a list of layer counts"
        )
    # fail on bad arguments before spending time profiling
    S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
    if S > len(model):
        raise ValueError(
            f"cannot split {len(model)} layers into {S} stages; use at most {len(model)} stages "
            "or split layers"
        )
    stage_footprint(schedule, S, chunks, order=order)
    _optimizer_factor(optimizer_state_factor)
    _check_cap(memory_cap_bytes)
    costs = profile_layers(model, sample, device=device, repeats=repeats)
    return partition(
        costs,
        S,
        objective=balance,
        schedule=schedule,
        chunks=chunks,
        memory_cap_bytes=memory_cap_bytes,
        optimizer_state_factor=optimizer_state_factor,
        order=order,
    )
