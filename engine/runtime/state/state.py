"""Pipeline state dicts: everything needed to resume bit-identically.

Why separate from the file format (:mod:`engine.serialization`): this module knows what a
pipeline's state *is* -- per stage the module's tensors, optimizer and scheduler state, the
update count and runtime-owned state (PipeMare's fallback delta), plus step counters and the
RNG -- and validates a state completely against a pipeline before anything changes. The file
format only knows nested dicts of tensors.

Under gloo/NCCL a process holds one stage, and its state dict holds that stage (each entry of
``stages`` names its ``index``); :mod:`engine.checkpoint_dir` writes one file per rank.

An unflushed asynchronous pipeline also saves its micro-batches in flight under
``"in_flight"`` (:mod:`~engine.runtime.state.inflight`, rebuilt on load); a flushed one's state has
no such key, so older checkpoints load unchanged. Loading needs a flushed (e.g. fresh) pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.errors import CheckpointError
from engine.runtime.state import inflight
from engine.runtime.state.model_index import stage_record

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts

__all__ = ["FORMAT", "pipeline_state_dict", "check_state", "load_pipeline_state_dict", "update_rule",
           "config_record"]

FORMAT = "engine.pipeline/1"


def config_record(parts: PipelineParts) -> dict[str, Any]:
    """The configuration a checkpoint records (a load into a pipeline of another is refused,
    or moved by :mod:`~engine.runtime.state.relayout`)."""
    return {
        "schedule": parts.spec.name,
        "stages": parts.spec.stages,
        "chunks": parts.spec.chunks,
        "update_size": parts.spec.update_size,
        "order": parts.spec.order,
        "prediction": parts.weight_prediction,
        "discrepancy_correction": parts.discrepancy_correction,
    }


def pipeline_state_dict(parts: PipelineParts) -> dict[str, Any]:
    """Everything needed to resume: per stage the module's tensors, optimizer and scheduler
    state, update count and runtime-owned state; plus counters and the torch RNG state."""
    broken = getattr(parts.rank, "broken", None)
    if broken:
        raise CheckpointError(f"cannot save: {broken}")
    in_flight = inflight.capture(parts)  # None when flushed; raises when it cannot be rebuilt
    stages = []
    for st in parts.stages:
        stages.append(
            {
                "module": {k: v.detach().clone() for k, v in st.module.state_dict().items()},
                # cloned: torch's optimizer state_dict() returns the live tensors, which
                # later steps would change under a state dict held in memory
                "optimizer": _cloned(st.optimizer.state_dict()) if st.bridge is not None else None,
                "optimizer_type": _type_name(st.optimizer) if st.bridge is not None else None,
                "scheduler": st.scheduler.state_dict() if st.scheduler is not None else None,
                "index": st.index,
                "updates": st.updates,
                "delay": parts.delays[st.index],
                "extra": (
                    {k: v.clone() for k, v in st.bridge.extra_state().items()}
                    if st.bridge is not None
                    else {}
                ),
            }
        )
        record = stage_record(parts, st)  # names in the whole model: a load may move layouts
        if record is not None:
            stages[-1]["names"] = record
    ex = parts.executor
    state = {
        "format": FORMAT,
        "config": config_record(parts),
        "steps": ex.steps,
        "skipped_steps": ex.skipped_steps,
        "microbatches": ex.n_base + ex.j * parts.spec.chunks,
        "stages": stages,
        "rng": torch.get_rng_state(),
        "update_rule": update_rule(parts),
    }
    if in_flight is not None:
        state["in_flight"] = in_flight
    return state


def update_rule(parts: PipelineParts) -> dict[str, Any]:
    """What a checkpoint's state means to the next update: synchronous schedules all mean
    the unpipelined model's update (one flushed mini-batch), so a load may change between
    them; an asynchronous one means its own weight policy and update size."""
    spec = parts.spec
    if spec.synchronous:
        return {"synchronous": True}
    return {"synchronous": False, "schedule": spec.name, "weights": spec.weights,
            "update_size": spec.update_size, "order": spec.order}


def _cloned(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


#: group keys the runtime or an LR scheduler sets: they may differ between a fresh pipeline
#: and a checkpoint of the same configuration
_RUNTIME_KEYS = {"params", "delay", "lr_scale", "prediction_lr", "prediction_horizon", "initial_lr",
                 "pipemare_scale", "pipemare_base", "pipemare_lr"}


def _plain(v: Any) -> Any:
    return float(v) if isinstance(v, Tensor) and v.numel() == 1 else v


def _check_optimizer(st: Any, sd: dict[str, Any], where: str, allow_change: bool) -> None:
    """The checkpoint's optimizer is of the stage's type with the same hyper-parameters
    (unless ``allow_change``): loading an SGD state into AdamW would run AdamW with SGD's
    learning rate and weight decay."""
    saved_type = sd.get("optimizer_type")
    mine = _type_name(st.optimizer)
    if saved_type is not None and saved_type != mine:
        raise _fail(f"{where}: the checkpoint's optimizer is {saved_type}, the pipeline's {mine}")
    if allow_change:
        return
    skip = set(_RUNTIME_KEYS) | ({"lr"} if st.scheduler is not None else set())
    diffs = []
    for g, (ours, theirs) in enumerate(zip(st.optimizer.param_groups, sd["optimizer"]["param_groups"], strict=True)):
        for key in sorted(set(ours) & set(theirs) - skip):
            a, b = _plain(ours[key]), _plain(theirs[key])
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                a, b = [_plain(x) for x in a], [_plain(x) for x in b]
            if a != b:
                diffs.append(f"param_groups[{g}]['{key}']: checkpoint {b!r} vs pipeline {a!r}")
    if diffs:
        raise _fail(
            f"{where}: optimizer hyper-parameters differ ({'; '.join(diffs)}); build the "
            "pipeline with the checkpoint's, or pass override_hyperparameters=True to "
            "engine.load to take the checkpoint's values"
        )


def _fail(msg: str) -> CheckpointError:
    return CheckpointError(msg + " -- nothing was loaded")


def check_state(parts: PipelineParts, state: Any, override_hyperparameters: bool = False) -> None:
    """Validate ``state`` against ``parts`` completely, so that loading changes nothing on error."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise _fail(f"not a pipeline state (format {got!r}, expected {FORMAT!r})")
    cfg = state.get("config", {})
    mine = config_record(parts)
    diff = [
        f"{k}: checkpoint {cfg.get(k)!r} vs pipeline {v!r}" for k, v in mine.items() if cfg.get(k) != v
    ]
    if diff:
        raise _fail(
            "checkpoint was written by a differently configured pipeline (" + "; ".join(diff) + ")"
        )
    stages = state.get("stages")
    if not isinstance(stages, list) or len(stages) != len(parts.stages):
        n = len(stages) if isinstance(stages, list) else "?"
        raise _fail(f"checkpoint has {n} stages, this process {len(parts.stages)}")
    for st, sd in zip(parts.stages, stages, strict=True):
        where = f"stage {st.index}"
        if sd.get("index", st.index) != st.index:
            raise _fail(f"{where}: the checkpoint holds stage {sd.get('index')} here")
        own = st.module.state_dict()
        theirs = sd.get("module", {})
        if set(own) != set(theirs):
            missing = sorted(set(own) - set(theirs))
            extra = sorted(set(theirs) - set(own))
            raise _fail(f"{where}: module tensors differ (missing {missing}, unexpected {extra})")
        for key, t in own.items():
            o = theirs[key]
            if not isinstance(o, Tensor) or o.shape != t.shape or o.dtype != t.dtype:
                got = (tuple(o.shape), o.dtype) if isinstance(o, Tensor) else type(o).__name__
                raise _fail(
                    f"{where}: {key} is {got} in the checkpoint, {(tuple(t.shape), t.dtype)} in the pipeline"
                )
        osd = sd.get("optimizer")
        if (osd is None) != (st.bridge is None):
            raise _fail(f"{where}: optimizer state does not match (a stage without parameters?)")
        if st.bridge is not None:
            groups = st.optimizer.param_groups
            sgroups = osd.get("param_groups", []) if isinstance(osd, dict) else []
            if len(groups) != len(sgroups) or any(
                len(g["params"]) != len(h.get("params", []))
                for g, h in zip(groups, sgroups, strict=False)
            ):
                raise _fail(f"{where}: optimizer param groups do not match the pipeline's")
            _check_optimizer(st, sd, where, override_hyperparameters)
        if (sd.get("scheduler") is None) != (st.scheduler is None):
            has = "has" if sd.get("scheduler") is not None else "has no"
            mine_has = "has" if st.scheduler is not None else "has no"
            raise _fail(f"{where}: checkpoint {has} LR scheduler state, the pipeline {mine_has} scheduler")
        if sd.get("delay") != parts.delays[st.index]:
            raise _fail(
                f"{where}: delay {sd.get('delay')} in the checkpoint, {parts.delays[st.index]} "
                "derived by the pipeline"
            )
        if not _count(sd.get("updates")):
            raise _fail(f"{where}: update count {sd.get('updates')!r} must be an int >= 0")
    for key in ("steps", "skipped_steps"):  # a hand-made state dict: counts the run goes on from
        if not _count(state.get(key, 0 if key == "skipped_steps" else None)):
            raise _fail(f"{key}={state.get(key)!r} must be an int >= 0")
    if "in_flight" in state:
        inflight.check(parts, state["in_flight"])
    rng = state.get("rng")
    if rng is not None and (not isinstance(rng, Tensor) or rng.dtype != torch.uint8):
        raise _fail("rng state must be a uint8 tensor")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def load_pipeline_state_dict(
    parts: PipelineParts, state: dict[str, Any], override_hyperparameters: bool = False
) -> None:
    """Load ``pipeline_state_dict`` output into a flushed pipeline of the same configuration
    (with ``override_hyperparameters``, optimizers whose hyper-parameters differ too)."""
    parts.require_flushed("load_state_dict()")
    check_state(parts, state, override_hyperparameters)
    for st, sd in zip(parts.stages, state["stages"], strict=True):
        with torch.no_grad():
            st.module.load_state_dict(sd["module"])  # copies into the live buffer in place
        if st.bridge is not None:
            st.optimizer.load_state_dict(sd["optimizer"])
            st.bridge.load_extra_state(sd.get("extra", {}))
        if st.scheduler is not None:
            st.scheduler.load_state_dict(sd["scheduler"])
        st.updates = sd["updates"]
        st.store.version = st.updates
        st.segment_updates = st.updates
        st.reset_in_flight()
        st.store.invalidate_transient()
    ex = parts.executor
    ex.steps = int(state["steps"])
    ex.skipped_steps = int(state.get("skipped_steps", 0))
    ex.n_base = int(state.get("microbatches", 0))
    ex.j = 0
    ex.active = False
    if "in_flight" in state:
        inflight.restore(parts, state["in_flight"])
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])
