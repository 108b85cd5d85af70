"""``engine.save`` and ``engine.load``: which format, and which way a load goes.

Why one dispatcher: a checkpoint is one file (a single-process pipeline,
:mod:`engine.serialization`) or a directory (one file per rank, :mod:`engine.checkpoint_dir`),
and a load may go three ways:

* into the layout that wrote it -- the same stages, names, schedule configuration and world
  layout: the state is loaded as saved, micro-batches in flight included, bit for bit;
* into another layout of the same model (another stage count, split, synchronous schedule,
  tensor- or data-parallel degree, a single process from a directory or the reverse):
  :mod:`~engine.runtime.state.relayout`, by the model names every stage records, each process
  reading only what its stages hold (docs/DESIGN.md, "Checkpoints across layouts");
* from a plain ``state_dict`` file (safetensors without the engine's metadata; e.g. what
  ``engine.export`` or Hugging Face wrote): the weights and buffers only (:mod:`engine.model_file`).

A checkpoint whose layout differs from the pipeline's, but whose stages (or the pipeline's)
declare no names, gets the same-layout load's refusal, which names the difference, and how
to declare names. Under gloo/NCCL every rank takes its own way and the ranks then agree in
one status exchange: either every rank loads or every rank raises, nothing changed.
"""

from __future__ import annotations

import os
from typing import Any

from engine import serialization
from engine.errors import CheckpointError

__all__ = ["save", "load"]


def save(pipe: Any, path: str | os.PathLike[str]) -> None:
    """Write ``pipe``'s state to ``path``, atomically: one safetensors + JSON file (single
    process), or under gloo/NCCL (every rank calls it) a directory of one file per rank and a
    manifest rank 0 writes last. Every stage with names in the model records them, so the
    checkpoint can later load into another layout (:func:`load`)."""
    if pipe.config.distributed:
        from engine.checkpoint_dir import save_dir

        save_dir(pipe, path)
    else:
        serialization.save(pipe, path)


def load(pipe: Any, path: str | os.PathLike[str], *, override_hyperparameters: bool = False) -> None:
    """Load ``path`` into a flushed pipeline; never unpickles (module docstring for the three
    ways). ``path``: what :func:`save` wrote -- from this layout, or (flushed, stages with
    names) from another layout of the same model -- or a plain ``state_dict`` file of the
    model. Errors (CheckpointError) leave the pipeline unchanged -- under gloo/NCCL on every
    rank, each naming the first rank that failed. The stage optimizers must be of the
    checkpoint's types with the same hyper-parameters unless ``override_hyperparameters``
    (the checkpoint's values then win, as ``torch.optim.Optimizer.load_state_dict``)."""
    path = os.fspath(path)
    if pipe.config.distributed:
        _load_ranks(pipe, path, override_hyperparameters)
        return
    plan = _plan(pipe, path, override_hyperparameters)
    _apply(pipe, plan, override_hyperparameters)


def _plan(pipe: Any, path: str, override: bool) -> tuple[str, Any]:
    """What to load, read and checked, nothing changed: ``("state", state dict)`` or
    ``("model", tensors per stage)``."""
    parts = pipe.parts
    # (a missing path: what a multi-process pipeline saves, a directory, is reported missing)
    isdir = os.path.isdir(path) or (parts.config.distributed and not os.path.exists(path))
    if not isdir and serialization.is_plain(path):
        from engine.model_file import model_file_tensors

        return "model", model_file_tensors(parts, path)
    if isdir and parts.config.distributed:
        from engine import checkpoint_dir

        saved_layout = checkpoint_dir.read_manifest(path).get("layout", {})
        same = _same_dir_layout(pipe, path)
        if same or not _dir_movable(pipe, path):
            try:
                return "state", _checked(parts, checkpoint_dir.read_own(pipe, path), override, pipe)
            except CheckpointError as exc:
                raise exc if same else _with_hint(exc, parts, saved_layout, _dir_named(path)) from None
    elif not isdir:
        sk = serialization.StateFile(path).skeleton()  # the header: a damaged file fails here
        if not parts.config.distributed and (_same_file_layout(parts, sk) or not _movable(parts, sk)):
            try:
                return "state", _checked(parts, serialization.read_state(path), override, pipe)
            except CheckpointError as exc:
                cfg = sk.get("config") if isinstance(sk, dict) else None
                if not isinstance(cfg, dict) or not _differs(parts, sk):
                    raise
                named = all(isinstance(sd.get("names"), dict) for sd in sk.get("stages", []))
                raise _with_hint(exc, parts, cfg, named) from None
    from engine.checkpoint_index import open_saved
    from engine.runtime.state.relayout import layouts, relayout_state

    saved = open_saved(path)
    state = relayout_state(parts, saved, override)
    try:
        return "state", _checked(parts, state, override, pipe)
    except CheckpointError as exc:  # (the checks of any load: optimizer type, scheduler, ...)
        raise CheckpointError(f"cannot load into another layout {layouts(parts, saved)}: {exc}") from None


def _checked(parts: Any, state: Any, override: bool, pipe: Any = None) -> Any:
    from engine.runtime.state.state import check_state

    if pipe is not None:
        from engine.runtime.precision import check_scaler_state

        check_scaler_state(pipe.parts.executor.loss_scaler, state)
    check_state(parts, {k: v for k, v in state.items() if k != "loss_scaler"}, override)
    return state


def _apply(pipe: Any, plan: tuple[str, Any], override: bool) -> None:
    kind, what = plan
    if kind == "model":
        from engine.model_file import load_model_tensors

        load_model_tensors(pipe.parts, what)
    else:
        pipe.load_state_dict(what, override_hyperparameters=override)


def _load_ranks(pipe: Any, path: str, override: bool) -> None:
    """Collective: every rank plans its own load, the ranks agree, every rank applies."""
    from engine.checkpoint_dir import _exchange, raise_first

    plan, error = None, ""
    try:
        plan = _plan(pipe, path, override)
    except Exception as exc:  # reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    raise_first(_exchange(pipe, "", error), f"loading checkpoint {path!r}")
    assert plan is not None
    _apply(pipe, plan, override)


def _records(parts: Any) -> list[Any]:
    from engine.runtime.state.model_index import stage_record

    return [stage_record(parts, st) for st in parts.stages]


def _same_names(parts: Any, saved_stages: list[Any]) -> bool:
    """The saved stages hold the same tensors by the same names (or either side has none)."""
    for rec, sd in zip(_records(parts), saved_stages, strict=False):
        theirs = sd.get("names") if isinstance(sd, dict) else None
        if rec is None or not isinstance(theirs, dict):
            continue
        if rec["names"] != theirs.get("names") or rec.get("shards", {}) != theirs.get("shards", {}):
            return False
    return True


def _same_file_layout(parts: Any, sk: Any) -> bool:
    from engine.runtime.state.state import config_record

    stages = sk.get("stages") if isinstance(sk, dict) else None
    return (isinstance(stages, list) and sk.get("config") == config_record(parts)
            and [sd.get("index") for sd in stages] == [st.index for st in parts.stages]
            and _same_names(parts, stages))


def _movable(parts: Any, sk: Any) -> bool:
    """Both sides know every stage's names: the load may go to another layout."""
    stages = sk.get("stages") if isinstance(sk, dict) else None
    return (isinstance(stages, list) and all(isinstance(sd.get("names"), dict) for sd in stages)
            and all(r is not None for r in _records(parts)))


def _differs(parts: Any, sk: Any) -> bool:
    """The checkpoint's stage count, schedule or micro-batches differ from the pipeline's."""
    from engine.runtime.state.state import config_record

    cfg, mine = sk.get("config", {}), config_record(parts)
    return any(cfg.get(k) != mine.get(k) for k in ("stages", "schedule", "chunks")) or \
        len(sk.get("stages", [])) != len(parts.stages)


def _with_hint(exc: CheckpointError, parts: Any, saved_layout: dict[str, Any], named: bool | None) -> CheckpointError:
    """The same-layout refusal of a checkpoint of another layout, plus why it cannot move:
    one side has no names in the model, and how to declare them."""
    from engine.checkpoint_index import describe_saved
    from engine.model_names import HOW_TO_DECLARE
    from engine.runtime.state.relayout import describe_layout

    lacking = []
    if named is None:
        lacking.append("the checkpoint's names cannot be read (its first file is missing or damaged)")
    elif not named:
        lacking.append("the checkpoint records no names in the whole model (its stages declared "
                       "none, or an engine from before names were recorded wrote it: save it "
                       "again from its own layout with named stages)")
    ours = [st.index for st, rec in zip(parts.stages, _records(parts), strict=True) if rec is None]
    if ours:
        lacking.append(f"stage(s) {ours} of this pipeline declare none")
    world = saved_layout.get("world") if "world" in saved_layout else None
    both = f"checkpoint: {describe_saved(saved_layout, world)}; this pipeline: {describe_layout(parts)}"
    return CheckpointError(
        f"{exc}. A checkpoint moves to another layout ({both}) by each stage's names in the "
        f"whole model, and {' and '.join(lacking) or 'they are missing'}; {HOW_TO_DECLARE}")


def _dir_named(path: str) -> bool | None:
    """The first file of directory ``path`` records names (None: it cannot be read)."""
    from engine import checkpoint_dir

    try:
        entry = checkpoint_dir.read_manifest(path)["ranks"][0]
        sk = serialization.StateFile(os.path.join(path, entry["file"])).skeleton()
    except (CheckpointError, KeyError, IndexError, TypeError):
        return None
    return all(isinstance(sd.get("names"), dict) for sd in sk.get("stages", []))


def _dir_movable(pipe: Any, path: str) -> bool:
    return all(r is not None for r in _records(pipe.parts)) and bool(_dir_named(path))


def _same_dir_layout(pipe: Any, path: str) -> bool:
    """This rank's file of directory ``path`` was written by the rank that held what this
    rank holds, under the same world layout, configuration and names."""
    from engine import checkpoint_dir
    from engine.runtime.state.state import config_record

    man = checkpoint_dir.read_manifest(path)
    if man.get("layout") != checkpoint_dir.layout_record(pipe):
        return False
    r = pipe.layout.rank
    entries = man.get("ranks", [])
    if not 0 <= r < len(entries):
        return False
    entry = entries[r]
    S = pipe.layout.stages
    here = getattr(pipe.layout, "place_of", lambda q: (q % S, q // S, 0))(r)
    if (entry.get("stage"), entry.get("replica"), entry.get("tp_rank", 0)) != here:
        return True  # same world, other places: the same-layout load names the mesh order
    file = os.path.join(path, entry.get("file", ""))
    if not os.path.exists(file):
        return True  # (the same-layout load names the missing file)
    sk = serialization.StateFile(file).skeleton()
    return sk.get("config") == config_record(pipe.parts) and _same_names(pipe.parts, sk.get("stages", []))
