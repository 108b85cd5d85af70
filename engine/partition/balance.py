"""Model-level entry points: cut an ``nn.Sequential`` by a balance, and find the balance.

Why this is its own file: these are the two calls the runtime and the command line make
(``Pipeline(balance="time")`` ends in :func:`balance_model`), and the only place where the
profiler and the solver meet; everything below them works on plain lists of costs.
:func:`balance_model` checks every argument before it spends time profiling.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine._checks import check_positive_int
from engine.partition.costs import _check_balance, _optimizer_factor
from engine.partition.footprint import stage_footprint
from engine.partition.profile import load_profile, profile_layers, save_profile
from engine.partition.solver import OBJECTIVES, _check_cap, partition

__all__ = ["balance_model", "split_sequential"]


def split_sequential(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into ``len(balance)`` consecutive ``nn.Sequential`` stages.

    The stages share the original modules (no copies) and keep their names, so a stage's
    ``state_dict`` keys are the model's (``"3.weight"`` stays ``"3.weight"``); each stage
    declares so (:mod:`engine.model_names`), and a checkpoint of them loads into any other
    cut of the model.
    """
    from engine.model_names import declare

    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    bal = _check_balance(balance, len(model), what="layers")
    children = list(model.named_children())
    out, i = [], 0
    for n in bal:
        out.append(declare(nn.Sequential(OrderedDict(children[i : i + n])), ""))
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
    profile: str | os.PathLike[str] | None = None,
) -> list[int]:
    """Profile ``model`` on ``sample`` (one micro-batch) and return the optimal balance.

    ``balance="time"`` or ``"memory"`` picks the objective (see :func:`partition`); a list is
    validated against the model and returned unchanged. Each layer's time is the median of
    ``repeats`` runs (raise it on a loaded machine). ``profile``: a JSON file of layer costs;
    when it exists it is used instead of measuring (checked against the model), otherwise
    the measurement is written there -- so reruns, and every rank, cut at the same layers.
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
    if profile is not None and os.path.exists(profile):
        costs = load_profile(model, profile)
    else:
        costs = profile_layers(model, sample, device=device, repeats=repeats)
        if profile is not None:
            dev = str(device if device is not None else next(model.parameters(), sample).device)
            save_profile(costs, model, profile, repeats=repeats, device=dev)
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
