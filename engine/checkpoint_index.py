"""Opening a checkpoint by its headers: what a load into another layout, or an export, reads.

Why headers only: a pipeline of another layout needs only the tensors its own stages hold,
and an export needs each tensor once. Every checkpoint file keeps its whole state skeleton
(every name, shape, counter and hyper-parameter) in its safetensors header, so
:func:`open_saved` reads the headers of a file or of every file of a directory
(:mod:`engine.checkpoint_dir`) and returns a
:class:`~engine.runtime.state.saved_index.Saved` whose tensors are
:class:`~engine.serialization.Lazy`: each is read -- and checked against its own SHA-256 --
only when a stage needs it. The directory's manifest is checked as on any load, and each
file's header checksum against the one the manifest committed.
"""

from __future__ import annotations

import os
from typing import Any

from engine.checkpoint_dir import read_manifest
from engine.errors import CheckpointError
from engine.runtime.state.saved_index import Saved, SavedStage
from engine.serialization import StateFile

__all__ = ["open_saved", "describe_saved", "in_flight"]


def describe_saved(layout: dict[str, Any], processes: int | None) -> str:
    """A saved layout in words, as refusals name it."""
    S = layout.get("stages")
    out = f"{S} stage{'s' if S != 1 else ''} of {layout.get('schedule')!r}"
    if layout.get("replicas", 1) > 1:
        out += f", data_parallel={layout['replicas']}"
    if layout.get("tensor_parallel", 1) > 1:
        out += f", tensor_parallel={layout['tensor_parallel']}"
    return out + (", one process" if processes is None else f", {processes} processes")


def _in_flight(state: Any) -> str | None:
    """What an in-flight state holds, in words (None when it holds nothing: a flushed rank
    may save an empty one)."""
    if not isinstance(state, dict):
        return None
    stash = sum(len(sd.get("stash", [])) for sd in state.get("stages", []))
    pending = sum(int(sd.get("pending", 0)) for sd in state.get("stages", []))
    boxes = len(state.get("inputs", [])) + len(state.get("acts", [])) + len(state.get("grads", []))
    if not (stash or pending or boxes):
        return None
    return (f"{stash} stashed forward(s), {pending} gradient(s) pending, {boxes} message(s) "
            "between stages")


def _top(skeleton: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in skeleton.items() if k not in ("stages", "in_flight")}


def _skeleton(f: StateFile) -> dict[str, Any]:
    sk = f.skeleton()
    if not isinstance(sk, dict) or not isinstance(sk.get("stages"), list):
        raise CheckpointError(f"{f.path!r} holds no pipeline state (no list of stages)")
    return sk


def open_saved(path: str | os.PathLike[str]) -> Saved:
    """The checkpoint at ``path`` (a file, or a directory with a manifest) by its headers."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return _open_dir(path)
    f = StateFile(path)
    sk = _skeleton(f)
    top = _top(sk)
    cfg = sk.get("config", {}) if isinstance(sk.get("config"), dict) else {}
    stages = [SavedStage(int(sd.get("index", i)), 0, 0, sd, top, path)
              for i, sd in enumerate(sk["stages"])]
    layout = describe_saved({"stages": cfg.get("stages"), "schedule": cfg.get("schedule")}, None)
    return Saved(path, layout, stages, _in_flight(sk.get("in_flight")))


def _open_dir(path: str) -> Saved:
    man = read_manifest(path)
    stages: list[SavedStage] = []
    unflushed = None
    for e in man["ranks"]:
        file = os.path.join(path, e["file"])
        if not os.path.exists(file):
            raise CheckpointError(f"rank {e['rank']}'s file {file!r}, named by the manifest, is missing")
        f = StateFile(file)
        want = e.get("index_sha256")
        if want is not None and f.meta.get("sha256") != want:
            raise CheckpointError(f"rank {e['rank']}'s file {file!r} is corrupted: its header "
                                  "checksum differs from the manifest's")
        sk = _skeleton(f)
        unflushed = unflushed or _in_flight(sk.get("in_flight"))
        top = _top(sk)
        for sd in sk["stages"]:
            stages.append(SavedStage(int(sd.get("index", e.get("stage", 0))), int(e.get("replica", 0)),
                                     int(e.get("tp_rank", 0)), sd, top, file))
    layout = describe_saved(man.get("layout", {}), man.get("layout", {}).get("world"))
    stages.sort(key=lambda s: (s.replica, s.tp_rank, s.index))
    return Saved(path, layout, stages, unflushed)


def in_flight(path: str | os.PathLike[str]) -> str | None:
    """What the checkpoint at ``path`` holds in flight, in words (None: it was saved flushed,
    so it may load into another layout); reads headers only."""
    return open_saved(path).unflushed
