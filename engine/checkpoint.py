"""Pipeline checkpoints: ``state_dict`` / ``load_state_dict`` and ``save`` / ``load`` files.

Why this format: a checkpoint must be safe to open from an untrusted source and must resume
bit-identically. Tensors go into a safetensors file (no pickle anywhere on load); everything
else (schedule, S, M, step counts, optimizer hyper-parameters and non-tensor state, LR
scheduler state) is JSON in the file's metadata, with tensors referenced by name. A SHA-256 of
all tensor bytes lives in the metadata too, because safetensors itself does not checksum data:
a flipped byte must give a clear error, not a silently different model. Files are written to a
temporary name and moved into place with ``os.replace`` so a crash never leaves a half file.

Only a flushed pipeline has a well-defined state (no activations or gradients in flight), so
both directions require one and say so otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.runtime.errors import CheckpointError

if TYPE_CHECKING:
    from engine.runtime.pipeline import Pipeline

__all__ = ["save", "load", "pipeline_state_dict", "load_pipeline_state_dict", "FORMAT"]

FORMAT = "engine.pipeline/1"
_META_KEY = "engine"


# ---------------------------------------------------------------------- state dicts


def _config(pipe: Pipeline) -> dict[str, Any]:
    return {
        "schedule": pipe.schedule,
        "stages": pipe.S,
        "chunks": pipe.M,
        "update_size": pipe.k,
        "order": pipe.order,
        "prediction": pipe.prediction,
        "discrepancy_correction": pipe.discrepancy_correction,
    }


def pipeline_state_dict(pipe: Pipeline) -> dict[str, Any]:
    """Everything needed to resume: per stage the module's tensors, optimizer and scheduler
    state, update count and runtime-owned state; plus counters and the torch RNG state."""
    pipe.require_flushed("state_dict()")
    stages = []
    for st in pipe.stages:
        stages.append(
            {
                "module": {k: v.detach().clone() for k, v in st.module.state_dict().items()},
                "optimizer": st.optimizer.state_dict(),
                "scheduler": st.scheduler.state_dict() if st.scheduler is not None else None,
                "updates": st.updates,
                "delay": st.bridge.delay,
                "extra": {k: v.clone() for k, v in st.bridge.extra_state().items()},
            }
        )
    return {
        "format": FORMAT,
        "config": _config(pipe),
        "steps": pipe.steps,
        "skipped_steps": pipe.skipped_steps,
        "microbatches": pipe._executor.n_base,
        "stages": stages,
        "rng": torch.get_rng_state(),
    }


def _fail(msg: str) -> CheckpointError:
    return CheckpointError(msg + " -- nothing was loaded")


def _check(pipe: Pipeline, state: Any) -> None:
    """Validate ``state`` against ``pipe`` completely, so that loading changes nothing on error."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise _fail(f"not a pipeline state (format {got!r}, expected {FORMAT!r})")
    cfg = state.get("config", {})
    mine = _config(pipe)
    diff = [
        f"{k}: checkpoint {cfg.get(k)!r} vs pipeline {v!r}"
        for k, v in mine.items()
        if cfg.get(k) != v
    ]
    if diff:
        raise _fail(
            "checkpoint was written by a differently configured pipeline (" + "; ".join(diff) + ")"
        )
    stages = state.get("stages")
    if not isinstance(stages, list) or len(stages) != pipe.S:
        raise _fail(
            f"checkpoint has {len(stages) if isinstance(stages, list) else '?'} stages, pipeline {pipe.S}"
        )
    for st, sd in zip(pipe.stages, stages, strict=False):
        where = f"stage {st.index}"
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
        osd = sd.get("optimizer", {})
        groups = st.optimizer.param_groups
        sgroups = osd.get("param_groups", [])
        if len(groups) != len(sgroups) or any(
            len(g["params"]) != len(h.get("params", []))
            for g, h in zip(groups, sgroups, strict=False)
        ):
            raise _fail(f"{where}: optimizer param groups do not match the pipeline's")
        if (sd.get("scheduler") is None) != (st.scheduler is None):
            raise _fail(
                f"{where}: checkpoint {'has' if sd.get('scheduler') is not None else 'has no'} LR scheduler state, the pipeline {'has' if st.scheduler is not None else 'has no'} scheduler"
            )
        if sd.get("delay") != st.bridge.delay:
            raise _fail(
                f"{where}: delay {sd.get('delay')} in the checkpoint, {st.bridge.delay} derived by the pipeline"
            )
        if not isinstance(sd.get("updates"), int):
            raise _fail(f"{where}: update count missing")
    rng = state.get("rng")
    if rng is not None and (not isinstance(rng, Tensor) or rng.dtype != torch.uint8):
        raise _fail("rng state must be a uint8 tensor")


def load_pipeline_state_dict(pipe: Pipeline, state: dict[str, Any]) -> None:
    """Load ``pipeline_state_dict`` output into a flushed pipeline of the same configuration."""
    pipe.require_flushed("load_state_dict()")
    _check(pipe, state)
    for st, sd in zip(pipe.stages, state["stages"], strict=False):
        with torch.no_grad():
            st.module.load_state_dict(sd["module"])  # copies into the live buffer in place
        st.optimizer.load_state_dict(sd["optimizer"])
        if st.scheduler is not None:
            st.scheduler.load_state_dict(sd["scheduler"])
        st.updates = sd["updates"]
        st.segment_updates = st.updates
        st.bridge.load_extra_state(sd.get("extra", {}))
        st.reset_in_flight()
    pipe.steps = int(state["steps"])
    pipe.skipped_steps = int(state.get("skipped_steps", 0))
    pipe._executor.n_base = int(state.get("microbatches", 0))
    if state.get("rng") is not None:
        torch.set_rng_state(state["rng"])


# ---------------------------------------------------------------------- files


def _encode(obj: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    """JSON-able skeleton of ``obj``; tensors are moved to ``tensors`` and referenced by name."""
    if isinstance(obj, Tensor):
        tensors[path] = obj.detach().clone().contiguous().cpu()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _encode(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            return {"__float__": repr(obj)}
        return obj
    raise CheckpointError(
        f"cannot save {path} of type {type(obj).__name__} without pickle; checkpoints hold tensors, "
        "numbers, strings, lists and dicts only (e.g. LambdaLR's lambdas are not saved by torch either)"
    )


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            name = obj["__tensor__"]
            if name not in tensors:
                raise CheckpointError(
                    f"checkpoint metadata references tensor {name!r}, which the file lacks"
                )
            return tensors[name]
        if "__dict__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise CheckpointError(f"unknown object in checkpoint metadata: keys {sorted(obj)}")
    return obj


def _digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save(pipe: Pipeline, path: str | os.PathLike[str]) -> None:
    """Write ``pipe.state_dict()`` to ``path`` (safetensors + JSON metadata), atomically."""
    from safetensors.torch import save_file

    state = pipeline_state_dict(pipe)
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, "s", tensors)
    meta = {"format": FORMAT, "sha256": _digest(tensors), "state": skeleton}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _read(path: str) -> dict[str, Any]:
    from safetensors.torch import load as st_load

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path!r}: {exc}") from exc
    bad = f"checkpoint {path!r} is corrupted or truncated"
    if len(data) < 8:
        raise CheckpointError(f"{bad}: {len(data)} bytes, not even a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(
            f"{bad}: header claims {n} bytes but the file has {len(data) - 8} after the length"
        )
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{bad} (or not an engine checkpoint): unreadable metadata ({exc})"
        ) from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path!r} has format {meta.get('format')!r}; this engine reads {FORMAT!r}"
        )
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type; name the file and the cause
        raise CheckpointError(f"{bad}: {exc}") from exc
    if _digest(tensors) != meta.get("sha256"):
        raise CheckpointError(f"{bad}: tensor data does not match its SHA-256 checksum")
    return _decode(meta["state"], tensors)


def load(pipe: Pipeline, path: str | os.PathLike[str]) -> None:
    """Load a file written by ``save`` into a flushed pipeline of the same configuration.

    Never unpickles. A missing, corrupted, truncated or mismatched file raises CheckpointError
    and leaves the pipeline unchanged."""
    state = _read(os.fspath(path))
    pipe.load_state_dict(state)
