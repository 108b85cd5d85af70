"""The plain model and back: ``engine.export`` and starting a pipeline from a ``state_dict``.

Why: a pipeline is a way to train a model, not a format to keep it in. ``engine.export``
gives the model's own ``state_dict`` -- names as in the model the stages were cut from
(:mod:`engine.model_names`; for ``engine.integrations.hf.split_causal_lm`` the Hugging Face model's, so
``model.load_state_dict(...)`` and ``save_pretrained`` work) -- from a pipeline of any layout
or from a checkpoint; ``engine.load(pipe, "model.safetensors")`` starts a pipeline from such
a file (or a Hugging Face one), each process reading only its stages' tensors, its
tensor-parallel shard by a safetensors slice.

A tied weight appears under every name the model gives it (``transformer.wte.weight`` and
``lm_head.weight``): ``load_state_dict(strict=True)`` wants both. Reading a file that has one
of them (``save_pretrained`` drops the head's), the other is taken from it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from engine.errors import CheckpointError
from engine.model_names import HOW_TO_DECLARE

__all__ = ["export", "model_file_tensors", "load_model_tensors"]


def export(source: Any) -> dict[str, Tensor]:
    """The plain model's ``state_dict`` (CPU tensors, model names) of ``source``: a pipeline
    -- flushed; under torchrun every rank calls it and rank 0 gets the whole dict, the others
    ``{}`` -- or the path of a checkpoint (a file, or a directory a multi-process run wrote;
    read here, in this process only). A stage without names in the model is refused with how
    to declare them."""
    if isinstance(source, (str, os.PathLike)):
        return _export_saved(os.fspath(source))
    parts = getattr(source, "parts", None)
    if parts is None:
        raise TypeError(f"engine.export takes a Pipeline or a checkpoint path, not {type(source).__name__}")
    parts.require_flushed("engine.export")
    from engine.runtime.state.model_index import needs_names, undeclared

    missing = undeclared(parts)
    why = needs_names("engine.export", missing) if missing else None
    if parts.config.distributed:
        return _export_ranks(source, why)
    if why is not None:
        raise CheckpointError(why)
    out: dict[str, Tensor] = {}
    owners: dict[tuple[int, str], str] = {}
    tied = []
    for st, rec in _records(parts):
        for local, t in st.module.state_dict().items():
            out[rec["names"][local]] = t.detach().cpu().clone()
        owners.update({(st.index, k): g for k, g in rec["names"].items()})
        tied += rec.get("tied", [])
    _fill_tied(out, tied, owners)
    return out


def _records(parts: Any) -> list[tuple[Any, dict[str, Any]]]:
    from engine.runtime.state.model_index import stage_record

    return [(st, stage_record(parts, st)) for st in parts.stages]


def _fill_tied(out: dict[str, Tensor], tied: list[dict[str, Any]], owners: dict[tuple[int, str], str]) -> None:
    """A carried tie's later holder has no tensor of its own: its name gets the owner's."""
    for t in tied:
        owner = owners.get((int(t["owner"][0]), t["owner"][1]))
        if owner in out and t["name"] not in out:
            out[t["name"]] = out[owner].clone()


def _export_ranks(pipe: Any, why: str | None) -> dict[str, Tensor]:
    """Collective: replica 0's ranks send their named tensors (tensor-parallel shards with
    their places) to rank 0, which joins the shards."""
    from engine.checkpoint_dir import control_group, gather_to_first

    parts = pipe.parts
    payload: dict[str, Any] = {"error": why or "", "tensors": [], "names": {}, "tied": []}
    tensors: list[Tensor] = []
    if why is None and parts.layout.replica == 0:
        for st, rec in _records(parts):
            shards = rec.get("shards", {})
            for local, t in st.module.state_dict().items():
                payload["tensors"].append([rec["names"][local], shards.get(local)])
                tensors.append(t.detach())
            payload["names"][str(st.index)] = rec["names"]
            payload["tied"] += rec.get("tied", [])
    # the control plane (gloo, host memory; NCCL's device tensors are copied to the host)
    got = gather_to_first(control_group(pipe), torch.device("cpu"), payload, tensors)
    errors = [p["error"] for p, _ in got if p["error"]] or ([why] if why else [])
    if errors:
        raise CheckpointError(errors[0])
    if not got:
        return {}
    pieces: dict[str, dict[int, Tensor]] = {}
    shard_of: dict[str, Any] = {}
    owners: dict[tuple[int, str], str] = {}
    tied: list[dict[str, Any]] = []
    for p, ts in got:
        for (name, sh), t in zip(p["tensors"], ts, strict=True):
            pieces.setdefault(name, {}).setdefault(sh["at"] if sh else 0, t)
            if sh:
                shard_of[name] = sh
        owners.update({(int(s), k): g for s, names in p["names"].items() for k, g in names.items()})
        tied += p["tied"]
    out = {}
    for name, by_at in pieces.items():
        sh = shard_of.get(name)
        out[name] = by_at[0] if sh is None else torch.cat([by_at[a] for a in range(sh["of"])], sh["dim"])
    _fill_tied(out, tied, owners)
    return out


def _export_saved(path: str) -> dict[str, Tensor]:
    from engine.checkpoint_index import open_saved
    from engine.runtime.state.saved_index import SavedIndex, assemble

    index = SavedIndex(open_saved(path))
    if index.missing:
        st = index.missing[0]
        raise CheckpointError(
            f"engine.export: checkpoint {path!r} stage {st.index} ({st.where}) records no names "
            f"in the whole model (saved by stages that declared none); {HOW_TO_DECLARE}, and "
            "save it again")
    out = {name: assemble(index.tensor(name), None, repr(name)) for name in index.module}  # type: ignore[arg-type]
    for name, owner in index.alias.items():
        out.setdefault(name, out[owner].clone())
    return out


# ------------------------------------------------------------------ starting from a state_dict


def model_file_tensors(parts: Any, path: str) -> dict[int, dict[str, Tensor]]:
    """Per stage of this process, its module's tensors read from the plain ``state_dict``
    file ``path`` by model name (a tensor-parallel shard by a slice); CheckpointError naming
    what is missing or mis-shaped. Nothing of the pipeline changes here."""
    from engine.runtime.state.model_index import needs_names, undeclared
    from engine.serialization import PlainFile

    missing = undeclared(parts)
    if missing:
        raise CheckpointError(needs_names(f"engine.load of the model file {path!r}", missing)
                              + " -- nothing was loaded")
    f = PlainFile(path)
    records = _records(parts)
    alias = _tie_aliases(parts, records)  # a file may hold a tied weight under one name only
    missing, out = [], {}
    for st, rec in records:
        shards = rec.get("shards", {})
        mine: dict[str, Tensor] = {}
        for local, t in st.module.state_dict().items():
            name = rec["names"][local]
            src = name if name in f.names else next((a for a in alias.get(name, []) if a in f.names), None)
            if src is None:
                missing.append(name)
                continue
            sh = shards.get(local)
            shape = tuple(sh["shape"]) if sh else tuple(t.shape)
            if f.shape(src) != shape:
                raise CheckpointError(f"model file {path!r}: {src!r} has shape {list(f.shape(src))}, "
                                      f"stage {st.index} holds {list(shape)} -- nothing was loaded")
            if sh is None:
                mine[local] = f.read(src)
            else:
                size = shape[sh["dim"]] // sh["of"]
                mine[local] = f.read(src, sh["dim"], sh["at"] * size, (sh["at"] + 1) * size)
        out[st.index] = mine
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"model file {path!r} lacks {sorted(missing)[:8]}{more}, which this "
                              "pipeline's stages hold; is it this model's state_dict? -- nothing "
                              "was loaded")
    if not parts.config.distributed:
        held = {rec["names"][k] for _, rec in records for k in rec["names"]}
        extra = sorted(n for n in f.names if n not in held and not any(n in a for a in alias.values()))
        if extra:
            raise CheckpointError(f"model file {path!r} holds {extra[:8]}, which no stage of this "
                                  "pipeline has; is it this model's state_dict? -- nothing was loaded")
    return out


def _tie_aliases(parts: Any, records: list[tuple[Any, dict[str, Any]]]) -> dict[str, list[str]]:
    """Model name -> the other names of the same tied weight (this process's stages)."""
    by_holder = {(st.index, k): g for st, rec in records for k, g in rec["names"].items()}
    from engine.model_names import naming_of

    modules = {st.index: st.module for st, _ in records}
    out: dict[str, list[str]] = {}
    for g in parts.ties:
        names = []
        for s, local in g.holders:
            name = by_holder.get((s, local))
            if name is None and s in modules and naming_of(modules[s]) is not None:
                name = naming_of(modules[s])(local)  # type: ignore[misc]
            if name is not None:
                names.append(name)
        for n in names:
            out[n] = [m for m in names if m != n]
    for _st, rec in records:  # one stage holding a weight under two names
        for names in rec["params"]:
            for n in names:
                out.setdefault(n, []).extend(m for m in names if m != n)
    return out


def load_model_tensors(parts: Any, tensors: dict[int, dict[str, Tensor]]) -> None:
    """Copy ``model_file_tensors`` output into the stages' live weights and buffers; the
    optimizer state, counters and RNG stay as they are (a fresh pipeline's)."""
    parts.require_flushed("engine.load")
    with torch.no_grad():
        for st in parts.stages:
            own = st.module.state_dict()
            for local, t in tensors.get(st.index, {}).items():
                own[local].copy_(t)
            st.reset_in_flight()
            st.store.invalidate_transient()
            if st.bridge is not None and st.bridge.predicts:  # its cached predictions are stale
                st.optimizer.load_state_dict(st.optimizer.state_dict())
