"""Checkpoint files: a pipeline's state dict as safetensors + JSON, never pickle.

Why this format: a checkpoint must be safe to open from an untrusted source and must resume
bit-identically. Tensors go into a safetensors file (no pickle anywhere on load); everything
else (schedule, S, M, step counts, optimizer hyper-parameters and non-tensor state, LR
scheduler state) is JSON in the file's metadata, with tensors referenced by name. A SHA-256 of
all tensor bytes *and* of that JSON lives in the metadata too, because safetensors itself does
not checksum anything: a flipped byte or a hand-edited learning rate or update count must give
a clear error, not a silently different run. (Format 1 files, whose checksum covered the
tensors only, are still read.) Files are written to a
temporary name and moved into place with ``os.replace`` so a crash never leaves a half file.

This module knows nested dicts of tensors, not pipelines: ``save``/``load`` call the object's
``state_dict()``/``load_state_dict()`` (:mod:`engine.runtime.state.state` says what a pipeline's
state is and validates it before anything changes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Any, Protocol

import torch
from torch import Tensor

from engine.errors import CheckpointError

__all__ = ["save", "load", "write_state", "read_state", "file_sha256", "FORMAT"]

FORMAT = "engine.pipeline/2"
_READABLE = ("engine.pipeline/1", FORMAT)
_META_KEY = "engine"


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


def _digest(tensors: dict[str, Tensor], skeleton: Any = None) -> str:
    """SHA-256 of every tensor (name, dtype, shape, bytes) and, from format 2 on, of the JSON
    skeleton (every non-tensor value of the state)."""
    h = hashlib.sha256()
    if skeleton is not None:
        h.update(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a whole file's bytes (what a manifest or a run log records for it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_state(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a state dict to ``path`` (safetensors + JSON metadata), atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, "s", tensors)
    meta = {"format": FORMAT, "sha256": _digest(tensors, skeleton), "state": skeleton}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    # created here first so a missing folder or a read-only one is an OSError naming the path
    # (errno intact, as a caller that handles a full disk expects), not safetensors' own error
    try:
        open(tmp, "wb").close()
    except OSError as exc:
        folder = os.path.dirname(os.path.abspath(path))
        where = f"the folder {folder!r} does not exist" if not os.path.isdir(folder) else exc.strerror
        raise OSError(exc.errno, f"cannot write checkpoint {path!r}: {where}", path) from None
    try:
        try:
            save_file(tensors, tmp, metadata={_META_KEY: json.dumps(meta)})
        except Exception as exc:  # SafetensorError: an I/O failure mid-write (e.g. a full disk)
            found = re.search(r"os error (\d+)", str(exc))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, f"cannot write checkpoint {path!r}: {os.strerror(code)}", path) from exc
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save(pipe: _Stateful, path: str | os.PathLike[str]) -> None:
    """Write ``pipe.state_dict()`` to ``path`` (safetensors + JSON metadata), atomically."""
    write_state(pipe.state_dict(), path)


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The state dict stored in ``path``; CheckpointError for anything unreadable."""
    path = os.fspath(path)
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
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in _READABLE:
        found = re.fullmatch(r"engine\.pipeline/(\d+)", fmt) if isinstance(fmt, str) else None
        newer = found is not None and int(found.group(1)) > int(FORMAT.rsplit("/", 1)[1])
        why = (
            " (a newer engine wrote it? load it there, or re-save it with a matching version)"
            if newer else f": {bad} (or not an engine checkpoint)"
        )
        raise CheckpointError(
            f"{path!r} has format {fmt!r}; this engine reads "
            + " and ".join(repr(f) for f in _READABLE) + why
        )
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type; name the file and the cause
        raise CheckpointError(f"{bad}: {exc}") from exc
    covers = meta.get("state") if meta["format"] != "engine.pipeline/1" else None
    if _digest(tensors, covers) != meta.get("sha256"):
        what = "tensor data" if covers is None else "tensor data or metadata"
        raise CheckpointError(f"{bad}: {what} does not match its SHA-256 checksum")
    return _decode(meta["state"], tensors)


def load(pipe: _Stateful, path: str | os.PathLike[str], *, override_hyperparameters: bool = False) -> None:
    """Load a file written by ``save`` into a flushed pipeline of the same configuration.

    Never unpickles. A missing, corrupted, truncated or mismatched file raises CheckpointError
    and leaves the pipeline unchanged. The stage optimizers must be of the checkpoint's types
    with the same hyper-parameters; ``override_hyperparameters=True`` accepts different ones
    (the checkpoint's values then win, as ``torch.optim.Optimizer.load_state_dict`` does)."""
    state = read_state(path)
    if override_hyperparameters:
        pipe.load_state_dict(state, override_hyperparameters=True)  # type: ignore[call-arg]
    else:
        pipe.load_state_dict(state)
