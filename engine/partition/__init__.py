"""Automatic partitioning: profile the layers of an ``nn.Sequential``, then split it into
pipeline stages that are as fast (``balance="time"``) or as small (``balance="memory"``) as
possible while every stage fits a memory cap.

Why this exists: a pipeline runs at the speed of its slowest stage, and a hand-typed
``balance=[...]`` is easily unbalanced or over a device's memory. Profiling each layer once
and solving the split exactly takes well under a second for hundreds of layers and removes the
guesswork. What a stage holds depends on the schedule and on the stage's position (PipeDream
stashes S-s weight versions at stage s, GPipe keeps all M micro-batches of activations), so
the split is solved under the schedule's footprint, not under one memory number per layer.

Why a package: this was one 800-line module holding five concepts that change for different
reasons and are wanted separately (the footprint by a schedule catalog, the profiler's byte
accounting by the command line, ``split_sequential`` by whoever builds stages). One concept per
file, each file's docstring says why it looks the way it does:

* :mod:`~engine.partition.footprint`: ``SCHEDULES`` and :func:`stage_footprint`, the weight
  versions and activation micro-batches each stage holds under each schedule (checked
  against the schedule simulator by the tests).
* :mod:`~engine.partition.costs`: :class:`LayerCost`, :class:`StageCost`, the memory formula
  and the exact integer cost model (``_Model``), :func:`stage_costs` to report a balance,
  ``OPTIMIZER_STATE_FACTORS``, and the checks of costs and balances.
* :mod:`~engine.partition.solver`: :func:`partition`, the exact O(S n^2) min-max dynamic
  programs, the deterministic tie-break, and the message that explains an infeasible cap.
* :mod:`~engine.partition.profile`: :func:`profile_layers`, which times each layer and counts
  its parameter, buffer and activation bytes, leaving the model as it found it.
* :mod:`~engine.partition.balance`: :func:`split_sequential` and :func:`balance_model`, the
  model-level calls that join the profiler and the solver.

Imports only go down this list's dependency order (footprint, then costs, then solver and
profile, then balance); footprint, costs and solver need no torch, and nothing here imports
``engine.runtime``. Every public name is re-exported here, so ``engine.partition.X`` keeps
working as before the split.
"""

from __future__ import annotations

from engine.partition.balance import balance_model, split_sequential
from engine.partition.costs import OPTIMIZER_STATE_FACTORS, LayerCost, StageCost, stage_costs
from engine.partition.footprint import SCHEDULES, stage_footprint
from engine.partition.profile import load_profile, profile_layers, save_profile
from engine.partition.solver import OBJECTIVES, partition

__all__ = [
    "OBJECTIVES",
    "OPTIMIZER_STATE_FACTORS",
    "SCHEDULES",
    "LayerCost",
    "StageCost",
    "balance_model",
    "load_profile",
    "partition",
    "profile_layers",
    "save_profile",
    "split_sequential",
    "stage_costs",
    "stage_footprint",
]
