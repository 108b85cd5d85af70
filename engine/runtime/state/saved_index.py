"""A saved checkpoint seen by the whole model's names: where each tensor's pieces are.

Why: a checkpoint is written per stage (and per rank), but a pipeline of another layout needs
each of *its* tensors, wherever the writer held it. Every saved stage records its tensors'
model names and tensor-parallel pieces (:mod:`~engine.runtime.state.model_index`), so the
headers alone say, for every model name, which files hold which pieces. :class:`SavedIndex`
builds that map from the saved stages' lazy skeletons (:class:`engine.serialization.Lazy`
leaves: nothing is read yet) and :func:`assemble` reads only the pieces a wanted tensor -- or
tensor-parallel shard of it -- overlaps, so no process reads, or holds, more of the model
than its own stages (docs/DESIGN.md, "Checkpoints across layouts").

What it indexes per model name: the module tensor (per data-parallel replica: buffers such
as BatchNorm statistics differ between replicas), and the per-parameter optimizer state with
what goes with it -- the parameter's param group, its stage's LR scheduler state, update
count and optimizer type, and the runtime's own per-parameter buffer (PipeMare's fallback
delta). Names a tied weight goes by without a tensor of its own resolve through ``alias``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.errors import CheckpointError

__all__ = ["SavedStage", "Saved", "Pieces", "OptPiece", "SavedIndex", "assemble", "materialise"]


@dataclass
class SavedStage:
    """One saved stage state as its writer held it (its tensors lazy)."""

    index: int
    replica: int
    tp_rank: int
    state: dict[str, Any]  #: the stage's state dict, Lazy leaves
    top: dict[str, Any]  #: the file's state without ``stages`` (counters, rng, ...)
    where: str  #: the file, for messages


@dataclass
class Saved:
    """A checkpoint (one file or a directory) opened by its headers."""

    path: str
    layout: str  #: the writer's layout, in words
    stages: list[SavedStage]
    #: why it cannot move to another layout (micro-batches in flight), or None
    unflushed: str | None = None


@dataclass
class Pieces:
    """The saved pieces of one tensor: the whole (``shard`` None) or tensor-parallel shards
    (``shard``: the writer's ``{"dim", "of", "shape"}``; ``pieces`` by position ``at``)."""

    shard: dict[str, Any] | None
    pieces: dict[int, Any] = field(default_factory=dict)

    def global_shape(self) -> tuple[int, ...]:
        if self.shard is not None:
            return tuple(self.shard["shape"])
        return tuple(self.pieces[min(self.pieces)].shape)


@dataclass
class OptPiece:
    """A parameter's optimizer state as one writer (one tp rank) held it."""

    entry: dict[str, Any] | None  #: its per-parameter state (None: no state yet)
    group: dict[str, Any]  #: its param group (hyper-parameters)
    group_index: int
    stage: SavedStage
    local_shape: tuple[int, ...]  #: the parameter as the writer held it (its shard)
    shard: dict[str, Any] | None = None  #: the writer's tensor-parallel shard of it
    delta: Any = None  #: the runtime's PipeMare delta for it (torch optimizers), if kept


class SavedIndex:
    """Model name -> saved pieces (module docstring). ``missing`` lists the saved stages
    that record no names (written by undeclared stages, or before names were recorded)."""

    def __init__(self, saved: Saved) -> None:
        self.saved = saved
        self.module: dict[str, dict[int, Pieces]] = {}  # name -> replica -> pieces
        self.optim: dict[str, dict[int, OptPiece]] = {}  # name -> tp position -> its state
        self.shards: dict[str, dict[str, Any]] = {}  # name -> the writer's shard
        self.alias: dict[str, str] = {}
        self.missing: list[SavedStage] = []
        carried: list[tuple[str, int, str]] = []
        local_of: dict[tuple[int, str], str] = {}
        for st in saved.stages:
            rec = st.state.get("names")
            if not isinstance(rec, dict):
                self.missing.append(st)
                continue
            names: dict[str, str] = rec["names"]
            shards: dict[str, Any] = rec.get("shards", {})
            for local, g in names.items():
                local_of.setdefault((st.index, local), g)
            for local, value in st.state.get("module", {}).items():
                g = names.get(local)
                if g is None:
                    continue
                sh = shards.get(local)
                if sh is not None:
                    self.shards.setdefault(g, sh)
                p = self.module.setdefault(g, {}).setdefault(st.replica, Pieces(_strip(sh)))
                p.pieces.setdefault(sh["at"] if sh else 0, value)
            self._optimizer(st, rec, names, shards)
            carried += [(t["name"], int(t["owner"][0]), t["owner"][1]) for t in rec.get("tied", [])]
        for name, stage, local in carried:
            owner = local_of.get((stage, local))
            if owner is not None and name not in self.module:
                self.alias[name] = owner

    def _optimizer(self, st: SavedStage, rec: dict[str, Any], names: dict[str, str],
                   shards: dict[str, Any]) -> None:
        osd = st.state.get("optimizer")
        if not isinstance(osd, dict):
            return  # a replica's own part, or a stage without parameters
        groups = osd.get("param_groups", [])
        state = osd.get("state", {})
        group_of = {pid: gi for gi, g in enumerate(groups) for pid in g.get("params", [])}
        by_name = {g: local for local, g in names.items()}
        extra = st.state.get("extra") or {}
        for i, gnames in enumerate(rec.get("params", [])):
            if i not in group_of or not gnames:
                continue  # a parameter the optimizer was not given
            local = by_name.get(gnames[0])
            held = st.state.get("module", {}).get(local)
            sh = shards.get(local) if local is not None else None
            piece = OptPiece(
                entry=state.get(i), group=groups[group_of[i]], group_index=group_of[i], stage=st,
                local_shape=tuple(getattr(held, "shape", ())), shard=_strip(sh),
                delta=extra.get(f"delta.{i}"),
            )
            for g in gnames:
                self.optim.setdefault(g, {}).setdefault(sh["at"] if sh else 0, piece)

    def resolve(self, name: str) -> str:
        """The name whose tensors ``name`` uses (itself, or a tied weight's owner)."""
        return name if name in self.module else self.alias.get(name, name)

    def tensor(self, name: str, replica: int = 0) -> Pieces | None:
        found = self.module.get(self.resolve(name))
        if not found:
            return None
        return found.get(replica, found.get(0, found[min(found)]))

    def state(self, name: str) -> dict[int, OptPiece] | None:
        return self.optim.get(self.resolve(name)) or self.optim.get(name)


def _strip(sh: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if sh is None else {"dim": sh["dim"], "of": sh["of"], "shape": list(sh["shape"])}


def _read(value: Any, what: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if value is None or not hasattr(value, "read"):
        raise CheckpointError(f"the checkpoint has no saved tensor for {what}")
    return value.read()


def _bounds(want: dict[str, Any], full: tuple[int, ...]) -> tuple[int, int]:
    size = full[want["dim"]] // want["of"]
    return want["at"] * size, (want["at"] + 1) * size


def assemble(p: Pieces, want: dict[str, Any] | None, what: str) -> Tensor:
    """Tensor ``p`` whole (``want`` None) or the shard ``want`` (``{"dim", "of", "at"}``),
    reading only the saved pieces it overlaps (module docstring)."""
    have = p.shard
    full = p.global_shape()
    if have is None:
        t = _read(p.pieces.get(0, p.pieces[min(p.pieces)]), what)
        if want is None:
            return t
        lo, hi = _bounds(want, full)
        return t.narrow(want["dim"], lo, hi - lo).clone()
    d, n = have["dim"], have["of"]
    missing = [a for a in range(n) if a not in p.pieces]
    size = full[d] // n
    if want is not None and want["dim"] == d:
        lo, hi = _bounds(want, full)
        use = range(lo // size, (hi - 1) // size + 1)
    else:
        lo, hi, use = 0, full[d], range(n)
    if any(a in missing for a in use):
        raise CheckpointError(f"{what}: the checkpoint lacks tensor-parallel pieces "
                              f"{[a for a in use if a in missing]} of {n}")
    parts = []
    for a in use:
        t = _read(p.pieces[a], f"{what} (piece {a} of {n})")
        s0, s1 = max(lo, a * size) - a * size, min(hi, (a + 1) * size) - a * size
        parts.append(t if (s0, s1) == (0, size) else t.narrow(d, s0, s1 - s0))
    out = torch.cat(parts, d) if len(parts) > 1 else parts[0].clone()
    if want is not None and want["dim"] != d:
        lo, hi = _bounds(want, full)
        out = out.narrow(want["dim"], lo, hi - lo).clone()
    return out


def materialise(obj: Any) -> Any:
    """``obj`` with every lazy tensor read (small trees: scheduler and loss-scaler states)."""
    if hasattr(obj, "read") and hasattr(obj, "name") and not isinstance(obj, Tensor):
        return obj.read()
    if isinstance(obj, dict):
        return {k: materialise(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [materialise(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(materialise(v) for v in obj)
    return obj
