"""Multi-process phases of the step features (clipping, mixed precision, trace) under gloo.

Why a file of its own: distributed_support.py is already long; its runner finds these phases
by the name ``features_dist_support:<phase>`` (:func:`spawn` here adds the prefix)."""

from __future__ import annotations

from distributed_support import transport_under_test

import traceback
from typing import Any

import torch
from distributed_support import DIM, _local, _train, configs, replica_rows, stage_factories
from distributed_support import spawn as _spawn
from torch import nn

STEPS = 4
CLIP = 0.02


def _clip_configs(S: int) -> dict[str, dict[str, Any]]:
    base = configs(S)
    names = ["gpipe", "1f1b-adam", "zbh1", "pb", "pb-lwp", "pipedream", "2bw"]
    return {n: dict(base[n], clip_grad_norm=CLIP) for n in names}


def phase_clip(rank: int, S: int, R: int = 1) -> dict[str, Any]:
    """Clipping under gloo vs the local run: bit for bit with one replica; with R replicas
    against one replica with the R-times larger batch (the mean over replicas rounds)."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    B = 8
    for name, kw in _clip_configs(S).items():
        if R > 1 and name not in ("gpipe", "pipedream"):
            continue
        try:
            pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                            data_parallel=R, timeout=30, **kw)
            shard = replica_rows(pipe.layout.replica, R, B // kw["chunks"]) if R > 1 else None
            losses = _train(pipe, STEPS, B=R * B, shard=shard)
            ref, ref_losses = _local(S, kw, STEPS, B=R * B)
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            norm, ref_norm = pipe.stats()["grad_norm"][0], ref.stats()["grad_norm"][s]
            out[name] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "max_diff": max(float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
                "norm": float(norm),
                "ref_norm": float(ref_norm),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def _amp_configs(S: int) -> dict[str, dict[str, Any]]:
    base = configs(S)
    fp16 = dict(autocast=torch.float16, grad_scaler=dict(init_scale=2.0**22, growth_interval=2))
    return {
        "gpipe-fp16": dict(base["gpipe"], **fp16),
        "1f1b-adam-fp16-clip": dict(base["1f1b-adam"], clip_grad_norm=CLIP, **fp16),
        "naive-torch-fp16": dict(base["naive"], **fp16),
        "1f1b-bf16": dict(base["1f1b-adam"], autocast=torch.bfloat16),
        "pb-bf16-clip": dict(base["pb"], autocast=torch.bfloat16, clip_grad_norm=CLIP),
        # asynchronous float16: one scale per stage, gradients carry theirs across ranks;
        # growing every group until it overflows, so the ranks' scales part ways; and one
        # that overflows from the start and backs off group by group
        "pb-fp16-clip": dict(base["pb"], autocast=torch.float16, clip_grad_norm=CLIP,
                             grad_scaler=dict(init_scale=2.0**6, growth_interval=1)),
        "pipedream-fp16-overflow": dict(base["pipedream"], autocast=torch.float16,
                                        grad_scaler=dict(init_scale=2.0**40)),
    }


def _scale(v: Any, s: int) -> float | None:
    """stats()["loss_scale"]: one tensor (synchronous), per stage a list (asynchronous)."""
    return None if v is None else float(v[s] if isinstance(v, list) else v)


def phase_amp(rank: int, S: int) -> dict[str, Any]:
    """Mixed precision under gloo vs the local run, bit for bit: float16's one found_inf per
    step spans the ranks (alone, or inside clipping's all-reduce)."""
    from engine import Pipeline

    out: dict[str, Any] = {}
    for name, kw in _amp_configs(S).items():
        try:
            pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                            timeout=30, **kw)
            losses = _train(pipe, 6)
            ref, ref_losses = _local(S, kw, 6)
            s = pipe.layout.stage
            mine = [p.detach() for p in pipe.stages[0].module.parameters()]
            theirs = [p.detach() for p in ref.stages[s].module.parameters()]
            initial = [p.detach() for p in stage_factories(S)[s]().parameters()]
            st, rst = pipe.stats(), ref.stats()
            xe = torch.randn(6, DIM, generator=torch.Generator().manual_seed(9))
            mine_eval = pipe.evaluate(xe)  # every rank: the last stage's outputs
            ref_eval = ref.evaluate(xe)
            whole = nn.Sequential(*[st_.module for st_ in ref.stages])
            with torch.no_grad(), torch.autocast("cpu", dtype=kw["autocast"]):
                torch_eval = torch.cat([whole(c) for c in xe.chunk(ref.spec.chunks)])
            out[name] = {
                "weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
                "eval_equal": torch.equal(mine_eval, ref_eval) and torch.equal(ref_eval, torch_eval),
                "eval_dtype": str(mine_eval.dtype),
                "moved": any(not torch.equal(a, b) for a, b in zip(mine, initial, strict=True)),
                "skipped": st["amp_skipped_steps"],
                "ref_skipped": rst["amp_skipped_steps"],
                "group_skips": None if st["amp_skipped_updates"] is None
                else st["amp_skipped_updates"][0],
                "ref_group_skips": None if rst["amp_skipped_updates"] is None
                else rst["amp_skipped_updates"][s],
                "scale": _scale(st["loss_scale"], 0),
                "ref_scale": _scale(rst["loss_scale"], s),
            }
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def phase_trace(rank: int, S: int, path: str) -> dict[str, Any]:
    """Every rank records inside ``pipe.trace(path)``; rank 0 writes the merged file."""
    from engine import Pipeline

    kw = dict(configs(S)["1f1b-adam"])
    pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport=transport_under_test(),
                    timeout=30, **kw)
    ref, _ = _local(S, kw, 3)
    with pipe.trace(path):
        _train(pipe, 3)
    s = pipe.layout.stage
    mine = [p.detach() for p in pipe.stages[0].module.parameters()]
    theirs = [p.detach() for p in ref.stages[s].module.parameters()]
    return {"weights_equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)),
            "throughput": pipe.stats()["throughput"]}


def spawn(world: int, phases: list[tuple[str, dict[str, Any]]], timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run ``phases`` (``phase_<name>`` of this module) on ``world`` gloo ranks, through
    distributed_support's runner; results keyed by the short names."""
    runs = _spawn(world, [(f"features_dist_support:{n}", kw) for n, kw in phases], timeout)
    return [{k.split(":", 1)[-1]: v for k, v in r.items()} for r in runs]
