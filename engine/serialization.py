"""Checkpoint files: a pipeline's state dict as safetensors + JSON, never pickle.

Why this format: a checkpoint must be safe to open from an untrusted source and must resume
bit-identically. Tensors go into a safetensors file (no pickle anywhere on load); everything
else (schedule, S, M, step counts, optimizer hyper-parameters and non-tensor state, LR
scheduler state) is JSON in the file's metadata, with tensors referenced by name. A SHA-256 of
all tensor bytes *and* of that JSON lives in the metadata too, because safetensors itself does
not checksum anything: a flipped byte or a hand-edited learning rate or update count must give
a clear error, not a silently different run. From format 3 on the metadata also holds each
tensor's own SHA-256, and the file's checksum covers the JSON and those per-tensor sums: a
reader that needs only some tensors (a load into another pipeline layout, which reads only the
slices its stages hold) verifies the header and every tensor it reads, without reading the
rest (:class:`StateFile`). (Format 1 files, whose checksum covered the tensors only, and
format 2 files, one checksum over everything, are still read.) Files are written to a
temporary name and moved into place with ``os.replace`` so a crash never leaves a half file.

A *plain* file -- safetensors without the engine's metadata, e.g. a Hugging Face
``model.safetensors`` or what ``engine.export`` writes -- holds one model's ``state_dict``
(:func:`write_plain`, :class:`PlainFile`).

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

__all__ = ["save", "load", "write_state", "read_state", "file_sha256", "FORMAT", "StateFile",
           "Lazy", "PlainFile", "write_plain", "is_plain"]

FORMAT = "engine.pipeline/3"
_READABLE = ("engine.pipeline/1", "engine.pipeline/2", FORMAT)
#: formats whose metadata holds each tensor's SHA-256 (a reader may read only some tensors)
_PER_TENSOR = (FORMAT,)
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


def _tensor_sha256(name: str, t: Tensor) -> str:
    """SHA-256 of one tensor: its name, dtype, shape and bytes."""
    h = hashlib.sha256()
    t = t.contiguous()
    h.update(name.encode())
    h.update(str(t.dtype).encode())
    h.update(repr(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _index_sha256(skeleton: Any, hashes: dict[str, str]) -> str:
    """Format 3's checksum: the JSON skeleton and every tensor's own SHA-256 (by name)."""
    h = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode())
    for name in sorted(hashes):
        h.update(name.encode())
        h.update(str(hashes[name]).encode())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a whole file's bytes (what a manifest or a run log records for it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_state(state: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write a state dict to ``path`` (safetensors + JSON metadata), atomically; returns the
    file's header checksum (what a reader of parts of it checks, :class:`StateFile`)."""
    tensors: dict[str, Tensor] = {}
    skeleton = _encode(state, "s", tensors)
    hashes = {name: _tensor_sha256(name, t) for name, t in tensors.items()}
    meta = {"format": FORMAT, "tensors": hashes, "sha256": _index_sha256(skeleton, hashes),
            "state": skeleton}
    _write_file(tensors, {_META_KEY: json.dumps(meta)}, path, "checkpoint")
    return str(meta["sha256"])


def _write_file(tensors: dict[str, Tensor], metadata: dict[str, str],
                path: str | os.PathLike[str], what: str) -> None:
    """safetensors ``tensors`` with ``metadata`` to ``path`` through a temporary name."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    # created here first so a missing folder or a read-only one is an OSError naming the path
    # (errno intact, as a caller that handles a full disk expects), not safetensors' own error
    try:
        open(tmp, "wb").close()
    except OSError as exc:
        folder = os.path.dirname(os.path.abspath(path))
        where = f"the folder {folder!r} does not exist" if not os.path.isdir(folder) else exc.strerror
        raise OSError(exc.errno, f"cannot write {what} {path!r}: {where}", path) from None
    try:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as exc:  # SafetensorError: an I/O failure mid-write (e.g. a full disk)
            found = re.search(r"os error (\d+)", str(exc))
            if found is None:
                raise
            code = int(found.group(1))
            raise OSError(code, f"cannot write {what} {path!r}: {os.strerror(code)}", path) from exc
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


def _header(head: bytes, size: int, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(safetensors header, engine metadata) of a file of ``size`` bytes starting ``head``
    (its first 8 + n bytes), format checked; CheckpointError otherwise."""
    bad = f"checkpoint {path!r} is corrupted or truncated"
    if size < 8:
        raise CheckpointError(f"{bad}: {size} bytes, not even a header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > size - 8:
        raise CheckpointError(
            f"{bad}: header claims {n} bytes but the file has {size - 8} after the length"
        )
    try:
        header = json.loads(head[8 : 8 + n])
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
    if fmt in _PER_TENSOR:
        hashes = meta.get("tensors")
        if not isinstance(hashes, dict) or _index_sha256(meta.get("state"), hashes) != meta.get("sha256"):
            raise CheckpointError(f"{bad}: tensor data or metadata does not match its SHA-256 checksum")
    return header, meta


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
    _, meta = _header(data, len(data), path)
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type; name the file and the cause
        raise CheckpointError(f"{bad}: {exc}") from exc
    if meta["format"] in _PER_TENSOR:
        hashes = meta["tensors"]
        if set(hashes) != set(tensors):
            raise CheckpointError(f"{bad}: its tensors are not the ones its metadata lists")
        for name in sorted(tensors):
            if _tensor_sha256(name, tensors[name]) != hashes[name]:
                raise CheckpointError(
                    f"{bad}: tensor data of {name!r} does not match its SHA-256 checksum")
        return _decode(meta["state"], tensors)
    covers = meta.get("state") if meta["format"] != "engine.pipeline/1" else None
    if _digest(tensors, covers) != meta.get("sha256"):
        what = "tensor data" if covers is None else "tensor data or metadata"
        raise CheckpointError(f"{bad}: {what} does not match its SHA-256 checksum")
    return _decode(meta["state"], tensors)


class Lazy:
    """A tensor of a :class:`StateFile` not read yet: ``lazy.read()`` reads and verifies it."""

    __slots__ = ("file", "name", "shape", "dtype")

    def __init__(self, file: StateFile, name: str) -> None:
        self.file, self.name = file, name
        info = file.info.get(name, {})
        self.shape: tuple[int, ...] = tuple(info.get("shape", ()))
        self.dtype: str = str(info.get("dtype", ""))

    def read(self) -> Tensor:
        return self.file.tensor(self.name)

    def __repr__(self) -> str:
        return f"Lazy({self.file.path!r}, {self.name!r}, shape={self.shape})"


class StateFile:
    """A checkpoint file opened by its header only: ``skeleton()`` is its state dict with
    :class:`Lazy` leaves in place of tensors, and each tensor is read when asked for, checked
    against its own SHA-256 (format 3; the header's checksum was checked on opening). An
    older file has no per-tensor sums: it is read and checked whole at the first tensor."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                head += f.read(min(n, max(size - 8, 0)))
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self.path!r}: {exc}") from exc
        header, self.meta = _header(head, size, self.path)
        self.info: dict[str, Any] = {k: v for k, v in header.items() if k != "__metadata__"}
        self.per_tensor = self.meta["format"] in _PER_TENSOR
        self._whole: dict[str, Tensor] | None = None

    def skeleton(self) -> Any:
        return _decode_lazy(self.meta["state"], self)

    def tensor(self, name: str) -> Tensor:
        bad = f"checkpoint {self.path!r} is corrupted or truncated"
        if not self.per_tensor:
            if self._whole is None:
                self._whole = {}
                _collect(read_state(self.path), self._whole, "s")
            if name not in self._whole:
                raise CheckpointError(f"{bad}: it lacks tensor {name!r}")
            return self._whole[name]
        from safetensors import safe_open

        want = self.meta["tensors"].get(name)
        if want is None:
            raise CheckpointError(f"checkpoint metadata references tensor {name!r}, which the "
                                  f"file {self.path!r} lacks")
        try:
            with safe_open(self.path, "pt") as f:
                t = f.get_tensor(name)
        except Exception as exc:  # safetensors' own error type: a truncated file, a bad offset
            raise CheckpointError(f"{bad}: cannot read {name!r} ({exc})") from exc
        if _tensor_sha256(name, t) != want:
            raise CheckpointError(f"{bad}: tensor data of {name!r} does not match its SHA-256 checksum")
        return t


def _collect(obj: Any, out: dict[str, Tensor], path: str) -> None:
    """The tensors of a decoded state by the names ``_encode`` gives them."""
    if isinstance(obj, Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, out, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, out, f"{path}.{i}")


def _decode_lazy(obj: Any, file: StateFile) -> Any:
    if isinstance(obj, list):
        return [_decode_lazy(v, file) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return Lazy(file, obj["__tensor__"])
        if "__dict__" in obj:
            return {k: _decode_lazy(v, file) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode_lazy(v, file) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise CheckpointError(f"unknown object in checkpoint metadata: keys {sorted(obj)}")
    return obj


# ------------------------------------------------------------------ plain state_dict files


def is_plain(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a safetensors file without the engine's metadata (a plain model
    ``state_dict``, e.g. a Hugging Face ``model.safetensors``); False for anything else."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(header, dict) and not (isinstance(meta, dict) and _META_KEY in meta)


def write_plain(tensors: dict[str, Tensor], path: str | os.PathLike[str]) -> None:
    """Write a model ``state_dict`` as a plain safetensors file (``{"format": "pt"}``, what
    Hugging Face writes), atomically. Tensors that share memory (a tied weight under two
    names) are written once each."""
    out = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    _write_file(out, {"format": "pt"}, path, "model file")


class PlainFile:
    """A plain ``state_dict`` file opened for reading single tensors or slices of them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = os.fspath(path)
        try:
            self._f = safe_open(self.path, "pt")
            self.names = set(self._f.keys())
        except Exception as exc:  # safetensors' own error type
            raise CheckpointError(f"cannot read model file {self.path!r}: {exc}") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> Tensor:
        """Tensor ``name``, or only its ``start:stop`` along ``dim`` (a tensor-parallel shard)."""
        try:
            if dim is None:
                return self._f.get_tensor(name)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            return self._f.get_slice(name)[index]
        except Exception as exc:
            raise CheckpointError(f"model file {self.path!r}: cannot read {name!r} ({exc})") from exc


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
