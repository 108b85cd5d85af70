"""Configuration agreement between the ranks of a multi-process pipeline, at construction.

Why: a rank started with another ``chunks``, schedule or mitigation does not fail by itself;
it waits for messages its peers never send, until the timeout, and the error names no
setting -- or worse, gpipe on one rank against 1f1b on the others runs silently. So before
anything else every rank sends every other rank a fingerprint of its configuration (JSON,
never pickle) and all of them compare: the settings of the whole pipeline must be equal on
every rank, the parameter shapes of a stage equal on every replica of that stage. A mismatch
raises the same PipelineConfigError on every rank, naming the setting and both values.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from engine.errors import PipelineConfigError
from engine.mitigations import MITIGATION_OPTIONS
from engine.runtime.ranks.transport.control import all_gather_bytes, world_group

__all__ = ["fingerprint", "agree"]


def fingerprint(
    spec: Any, cfg: Any, options: dict[str, Any], ties: list[Any], opt: Any, module: nn.Module
) -> dict[str, Any]:
    """What must agree: the pipeline's settings (schedule, transport, recomputation, the
    keyword ``options``, ties, the optimizer's mitigations) on every rank -- a stage without
    parameters has no optimizer, so it omits those -- and the stage's parameters (names,
    shapes, dtypes) on every replica of the stage."""
    import engine

    pipe_settings: dict[str, Any] = {
        "schedule": spec.name,
        "stages": spec.stages,
        "chunks": spec.chunks,
        "update_size": spec.update_size,
        "order": spec.order,
        "transport": cfg.transport,
        "data_parallel": cfg.data_parallel,
        "checkpoint": cfg.checkpoint,
        "on_nonfinite": cfg.on_nonfinite,
        **options,
        "tied parameters": [g.describe() for g in ties],
    }
    if opt is not None:
        pipe_settings["optimizer mitigations"] = {
            k: opt.defaults[k]
            for k in MITIGATION_OPTIONS
            if opt.defaults.get(k) is not None
        }
    settings = [[k, v] for k, v in pipe_settings.items()] + [["engine version", engine.__version__]]
    return {
        "pipeline": settings,  # a list: the first difference is reported in this order
        "stage": [[n, list(p.shape), str(p.dtype)] for n, p in module.named_parameters()],
    }


def _all_gather_json(obj: Any, timeout: float | None) -> list[Any]:
    """Every rank's ``obj`` as JSON over the world's control group (gloo, host memory)."""
    group = world_group(timeout)
    return [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(obj).encode(), group)]


def agree(
    mine: dict[str, Any], rank: int, stages: int, device: torch.device, stage_of: Any = None,
    timeout: float | None = None,
) -> None:
    """Exchange fingerprints with every rank (on the world's control group; ``device`` is
    where the rank's stage lives, unused by the exchange); raise on every rank at the first
    difference.
    ``stage_of``: rank -> (stage, replica, tp rank) under a mesh (runtime/ranks/mesh.py); the ranks
    that compare parameters are then those with the same stage and tp rank."""
    prints = _all_gather_json(mine, timeout)
    keys: list[str] = []
    for fp in prints:
        keys += [k for k, _ in fp["pipeline"] if k not in keys]
    for key in keys:  # compared among the ranks that have it (a stage without parameters
        # has no optimizer settings)
        have = [(r, dict(fp["pipeline"])[key]) for r, fp in enumerate(prints) if key in dict(fp["pipeline"])]
        r0, a = have[0]
        for r, b in have[1:]:
            if a != b:
                raise PipelineConfigError(
                    f"the ranks disagree on {key}: rank {r0} has {a!r}, rank {r} has {b!r}; start "
                    "every rank with the same Pipeline settings (this rank is "
                    f"{rank}; nothing was run)"
                )
    for r, fp in enumerate(prints):
        first = r % stages  # replica 0's rank of this stage
        if stage_of is not None:  # the first rank with this rank's stage and tp position
            first = next(q for q in range(len(prints)) if _same(stage_of, q, r))
        if fp["stage"] != prints[first]["stage"]:
            theirs, other = prints[first]["stage"], fp["stage"]
            diff = next(
                (f"{a[0]}: {a[1]} {a[2]} vs {b[1]} {b[2]}" for a, b in zip(theirs, other, strict=False) if a != b),
                f"{len(theirs)} vs {len(other)} parameters",
            )
            stage = first if stage_of is None else stage_of(r)[0]
            raise PipelineConfigError(
                f"the replicas of stage {stage} disagree on its parameters (rank {first} vs rank "
                f"{r}: {diff}); every replica must build the same stage module (this rank is "
                f"{rank}; nothing was run)"
            )


def _same(stage_of: Any, a: int, b: int) -> bool:
    (sa, _, ta), (sb, _, tb) = stage_of(a), stage_of(b)
    return bool(sa == sb and ta == tb)
