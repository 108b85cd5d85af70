"""Loading a checkpoint into another layout of the same model: this process's stage states.

Why a translation and not a second loader: :func:`relayout_state` turns a saved checkpoint
(any stage count, split, schedule of the same update rule, tensor- or data-parallel degree;
:class:`~engine.runtime.state.saved_index.Saved`) into exactly the state dict this process's
own ``state_dict()`` would have -- its stages, its names, its shards -- and the ordinary
:func:`~engine.runtime.state.state.load_pipeline_state_dict` loads it, with every check it
makes (module tensors, optimizer type and hyper-parameters, scheduler). So a moved checkpoint
is validated completely before anything changes, like any other.

How each part moves (docs/DESIGN.md, "Checkpoints across layouts"):

* module tensors by model name; a tensor-parallel shard is cut from the saved pieces it
  overlaps; data-parallel replica r takes replica r's buffers if the writer had one, else
  replica 0's (parameters are replica 0's: all replicas held them alike);
* per-parameter optimizer state (momentum, Adam's moments and step, the mitigations'
  buffers: SC's and LWP's kept updates, PipeMare's delta) follows its parameter, sharded as
  it is where it has the parameter's shape; each param group takes the hyper-parameters of
  the saved groups its parameters came from (they must agree), with this pipeline's delay;
* an LR scheduler's per-group lists follow the groups, its counters must agree; the update
  count must agree between the saved stages a new stage draws from;
* step counters, the RNG state (of the file the stage's first parameter came from; random
  layers draw differently in another layout anyway) and the loss scale as saved.

Refused, naming both layouts and what would make the load possible: micro-batches in flight
(their activations and stashed versions exist only in the writer's layout), another update
rule, stages without names, and a name this pipeline needs that the checkpoint lacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.errors import CheckpointError
from engine.model_names import HOW_TO_DECLARE
from engine.runtime.state.model_index import stage_record, undeclared
from engine.runtime.state.saved_index import (
    OptPiece, Pieces, Saved, SavedIndex, assemble, materialise,
)
from engine.runtime.state.state import FORMAT, config_record, update_rule

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts
    from engine.runtime.stage.stage import Stage

__all__ = ["relayout_state", "describe_layout", "layouts"]

#: group keys the new layout sets itself (they depend on the stage's place in the schedule)
_OWN_KEYS = ("delay", "prediction_horizon")


def describe_layout(parts: PipelineParts) -> str:
    """This pipeline's layout in words, as refusals name it."""
    lay = parts.layout
    S = parts.spec.stages
    out = f"{S} stage{'s' if S != 1 else ''} of {parts.spec.name!r}"
    if lay is None:
        return out + ", one process"
    if parts.replicas > 1:
        out += f", data_parallel={parts.replicas}"
    if getattr(lay, "tp", 1) > 1:
        out += f", tensor_parallel={lay.tp}"
    return out + f", {lay.world} processes"


def layouts(parts: PipelineParts, saved: Saved) -> str:
    """Both layouts, as every refusal of a move names them."""
    return f"(checkpoint {saved.path!r}: {saved.layout}; this pipeline: {describe_layout(parts)})"


def relayout_state(parts: PipelineParts, saved: Saved, override_hyperparameters: bool = False) -> dict[str, Any]:
    """The state dict of this process's stages, taken from ``saved`` (module docstring);
    reads only the pieces of the checkpoint those stages hold. Raises CheckpointError (and
    changes nothing) for every refusal."""
    both = layouts(parts, saved)

    def refuse(why: str, fix: str) -> CheckpointError:
        return CheckpointError(f"cannot load into another layout {both}: {why}; {fix} -- nothing was loaded")

    parts.require_flushed("engine.load")
    if saved.unflushed:
        raise refuse(
            f"it was saved unflushed ({saved.unflushed}), and micro-batches in flight exist only "
            "in the layout that ran them",
            "call pipe.flush() before engine.save, or load it into a pipeline of the layout "
            "that wrote it")
    index = SavedIndex(saved)
    if index.missing:
        st = index.missing[0]
        raise refuse(
            f"its stage {st.index} ({st.where}) records no names in the whole model (saved by "
            "stages that declared none, or by an engine before names were recorded)",
            "load it into a pipeline of the layout that wrote it; to move it, save it from "
            f"there with named stages: {HOW_TO_DECLARE}")
    missing = undeclared(parts)
    if missing:
        raise refuse(f"stage(s) {missing} of this pipeline declare no names in the whole model "
                     "(hand-made modules or factories)", HOW_TO_DECLARE)
    top = saved.stages[0].top
    theirs, mine = top.get("update_rule"), update_rule(parts)
    cfg_t, cfg_m = top.get("config", {}), config_record(parts)
    same = isinstance(theirs, dict) and (theirs == mine or (theirs.get("synchronous") and mine["synchronous"]))
    for key in ("prediction", "discrepancy_correction"):
        same = same and cfg_t.get(key) == cfg_m.get(key)
    if not same:
        raise refuse(
            f"another update rule (checkpoint {_rule_text(theirs, cfg_t)}, this pipeline "
            f"{_rule_text(mine, cfg_m)})",
            "every synchronous schedule continues any synchronous checkpoint, an asynchronous "
            "one only its own schedule, update size, order, prediction and correction; build "
            "the pipeline with the checkpoint's")
    records = [(st, stage_record(parts, st)) for st in parts.stages]
    replica = getattr(parts.layout, "replica", 0) if parts.layout is not None else 0
    lacking = sorted({g for st, rec in records for g in rec["names"].values()  # type: ignore[index]
                      if index.tensor(g, replica) is None})
    if lacking:
        more = f" and {len(lacking) - 8} more" if len(lacking) > 8 else ""
        raise refuse(f"it lacks {lacking[:8]}{more}, which this pipeline's stages hold",
                     "load a checkpoint of the same model (the names must match the model's)")
    stages = [_stage(parts, st, rec, index, replica, override_hyperparameters, refuse)  # type: ignore[arg-type]
              for st, rec in records]
    first = _first_source(index, records) or saved.stages[0]
    src = first.top
    state: dict[str, Any] = {
        "format": FORMAT, "config": cfg_m,
        "steps": src.get("steps"), "skipped_steps": src.get("skipped_steps", 0),
        "microbatches": src.get("microbatches", 0), "stages": stages,
        "rng": materialise(src.get("rng")), "update_rule": mine,
    }
    if src.get("loss_scaler") is not None:
        state["loss_scaler"] = materialise(src["loss_scaler"])
    return state


def _rule_text(rule: Any, cfg: dict[str, Any]) -> str:
    if not isinstance(rule, dict):
        return "unknown (written before update rules were recorded)"
    if rule.get("synchronous"):
        text = "synchronous"
    else:
        text = (f"{rule.get('schedule')!r} (weights {rule.get('weights')!r}, update_size "
                f"{rule.get('update_size')}, order {rule.get('order')!r})")
    extra = [f"{k}={cfg.get(k)!r}" for k in ("prediction", "discrepancy_correction") if cfg.get(k)]
    return text + (f" with {', '.join(extra)}" if extra else "")


def _first_source(index: SavedIndex, records: list[Any]) -> Any:
    for _st, rec in records:
        for names in rec["params"]:
            found = index.state(names[0]) if names else None
            if found:
                return found[min(found)].stage
    return None


def _stage(parts: PipelineParts, st: Stage, rec: dict[str, Any], index: SavedIndex, replica: int,
           override: bool, refuse: Any) -> dict[str, Any]:
    """One new stage's state dict (module docstring)."""
    shards = rec.get("shards", {})
    module: dict[str, Tensor] = {}
    own = st.module.state_dict()
    for local, t in own.items():
        g = rec["names"][local]
        p = index.tensor(g, replica)
        assert p is not None  # (checked by the caller)
        want = shards.get(local)
        shape = tuple(want["shape"]) if want else tuple(t.shape)
        if p.global_shape() != shape:
            raise refuse(f"{g!r} has shape {list(p.global_shape())} in the checkpoint, "
                         f"{list(shape)} in this pipeline's stage {st.index}",
                         "load a checkpoint of the same model")
        module[local] = assemble(p, want, repr(g))
    out: dict[str, Any] = {
        "module": module, "optimizer": None, "optimizer_type": None, "scheduler": None,
        "index": st.index, "updates": 0, "delay": parts.delays[st.index], "extra": {},
        "names": rec,
    }
    pieces = [index.state(names[0]) if names else None for names in rec["params"]]
    sources = [p[min(p)] for p in pieces if p]
    updates = {s.stage.state.get("updates") for s in sources}
    if len(updates) > 1:
        raise refuse(f"stage {st.index} takes parameters from saved stages with different update "
                     f"counts {sorted(updates)}", "load it into the layout that wrote it")
    out["updates"] = updates.pop() if updates else index.saved.stages[0].state.get("updates", 0)
    if st.bridge is None:
        return out
    types = {s.stage.state.get("optimizer_type") for s in sources}
    if len(types) > 1:
        raise refuse(f"stage {st.index} takes parameters from stages with optimizers {sorted(types)}",
                     "use one optimizer type for every stage")
    out["optimizer_type"] = types.pop() if types else None
    out["optimizer"] = _optimizer(st, rec, pieces, shards, override, refuse)
    deltas = [p[min(p)].delta if p else None for p in pieces]
    if any(d is not None for d in deltas):  # the runtime's PipeMare delta (torch optimizers):
        wants = _wants(rec, shards)  # a parameter whose saved stage kept none (delay 0) starts at 0
        out["extra"] = {
            f"delta.{i}": (_state_tensor(pieces[i], "delta", d, rec, i, wants[i]) if d is not None
                           else torch.zeros_like(st.store.params[i].detach()))
            for i, d in enumerate(deltas)}
    if st.scheduler is not None:
        out["scheduler"] = _scheduler(st, pieces, refuse)
    return out


def _wants(rec: dict[str, Any], shards: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Per parameter of the new stage (optimizer order), its tensor-parallel shard (or None)."""
    by_name = {g: local for local, g in rec["names"].items()}
    out = []
    for names in rec["params"]:
        local = by_name.get(names[0]) if names else None
        out.append(shards.get(local) if local is not None else None)
    return out


def _state_tensor(by_at: dict[int, OptPiece], key: str, value: Any, rec: dict[str, Any], i: int,
                  want: dict[str, Any] | None) -> Any:
    """One per-parameter state value for new parameter ``i``: sharded as its parameter where
    it has the parameter's shape, else (a step count) as saved."""
    if not hasattr(value, "read"):
        return value
    first = by_at[min(by_at)]
    if tuple(value.shape) != first.local_shape:
        return value.read()
    if first.shard is None:
        p = Pieces(None, {0: value})
    else:
        p = Pieces(first.shard, {a: o.delta if key == "delta" else (o.entry or {}).get(key)
                                 for a, o in by_at.items()})
    return assemble(p, want, f"{rec['params'][i][0]!r}'s {key}")


def _optimizer(st: Stage, rec: dict[str, Any], pieces: list[Any], shards: dict[str, Any],
               override: bool, refuse: Any) -> dict[str, Any]:
    """The new stage optimizer's state_dict: per-parameter state by model name, groups from
    the saved groups of their parameters (module docstring)."""
    current = st.optimizer.state_dict()
    wants = _wants(rec, shards)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for gi, (group, saved_group) in enumerate(zip(st.optimizer.param_groups, current["param_groups"], strict=True)):
        ids = list(saved_group["params"])
        found: list[dict[str, Any]] = []
        for pid in ids:
            by_at = pieces[pid] if pid < len(pieces) else None
            if not by_at:
                continue
            first = by_at[min(by_at)]
            found.append(first.group)
            if first.entry is not None:
                state[pid] = {k: _state_tensor(by_at, k, v, rec, pid, wants[pid])
                              for k, v in first.entry.items()}
        base = {k: v for k, v in (found[0] if found else group).items() if k != "params"}
        differ = _differences(found)
        if differ and not override:
            raise refuse(
                f"param group {gi} of stage {st.index} takes parameters from saved groups whose "
                f"hyper-parameters differ ({differ})",
                "pass override_hyperparameters=True to engine.load to keep this pipeline's, or "
                "load into the layout that wrote it")
        if differ or not found:
            base = {k: v for k, v in group.items() if k != "params"}
        for key in _OWN_KEYS:
            if key in group:
                base[key] = group[key]
            else:
                base.pop(key, None)
        groups.append({**base, "params": ids})
    return {"state": state, "param_groups": groups}


def _differences(groups: list[dict[str, Any]]) -> str:
    if len(groups) < 2:
        return ""
    keys = sorted(set().union(*groups) - {"params", *_OWN_KEYS})
    out = []
    for key in keys:
        seen = {repr(_plain(g.get(key))) for g in groups}
        if len(seen) > 1:
            out.append(f"{key}: {sorted(seen)}")
    return "; ".join(out)


def _plain(v: Any) -> Any:
    if hasattr(v, "read") and hasattr(v, "shape"):
        return ("tensor", tuple(v.shape))
    if isinstance(v, Tensor) and v.numel() == 1:
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _scheduler(st: Stage, pieces: list[Any], refuse: Any) -> Any:
    """The LR scheduler state of the new stage: per-group lists follow the groups, the rest
    (its counters) must agree between the saved stages it draws from."""
    firsts = [p[min(p)] for p in pieces if p]
    if not firsts:
        return None
    base = firsts[0].stage.state.get("scheduler")
    if not isinstance(base, dict):
        return base
    per_group = {}
    for gi, group in enumerate(st.optimizer.state_dict()["param_groups"]):
        src = next((pieces[pid][min(pieces[pid])] for pid in group["params"]
                    if pid < len(pieces) and pieces[pid]), firsts[0])
        per_group[gi] = src
    out = {}
    for key, value in base.items():
        ngroups = len((firsts[0].stage.state.get("optimizer") or {}).get("param_groups", []))
        if isinstance(value, list) and len(value) == ngroups:
            out[key] = [
                (src.stage.state.get("scheduler") or {}).get(key, value)[src.group_index]
                for _, src in sorted(per_group.items())
            ]
            continue
        for other in firsts[1:]:
            theirs = (other.stage.state.get("scheduler") or {}).get(key)
            if repr(_plain(theirs)) != repr(_plain(value)):
                raise refuse(
                    f"stage {st.index}'s LR scheduler draws from saved stages whose {key!r} "
                    f"differ ({_plain(value)!r} vs {_plain(theirs)!r})",
                    "load into the layout that wrote it")
        out[key] = value
    return materialise(out)
