"""What a stage's state records about its tensors' places in the whole model.

Why: a checkpoint moves to another layout of the model (stage count, split, tensor- or
data-parallel degree; :mod:`~engine.runtime.state.relayout`) and exports to the plain model
only if each saved tensor says which tensor of the model it is. So every stage whose module
declares a naming (:mod:`engine.model_names`) saves, next to its state, a small record:

* ``names``: ``{state_dict key: name in the model}`` for the module's parameters and buffers;
* ``params``: per parameter of the stage's weight store -- the optimizer's parameter order,
  so also the order of its per-parameter state -- every model name it goes by (a tied weight
  that one stage holds under two names has two);
* ``shards``: per tensor-parallel shard, ``{"dim", "of", "at", "shape"}``: this rank's
  ``at``-th of ``of`` equal pieces along ``dim`` of a tensor of global ``shape``;
* ``tied``: the later holders of a tied weight whose value an asynchronous schedule carries
  from its owner (runtime/ties/carry.py): their module has no tensor of that name, so
  the record says whose value it is (the owner's stage and name there).

Plain JSON: it travels in the checkpoint's metadata, so a reader finds every name from the
headers alone, without reading a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import CheckpointError
from engine.model_names import HOW_TO_DECLARE, NamesError, module_names, naming_of
from engine.runtime.tensor_parallel import stage_tp

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts
    from engine.runtime.stage.stage import Stage

__all__ = ["stage_record", "undeclared", "needs_names", "Shard"]

Shard = dict[str, Any]  #: {"dim": d, "of": n, "at": i, "shape": [global shape]}


def stage_record(parts: PipelineParts, st: Stage) -> dict[str, Any] | None:
    """The record of ``st`` (module docstring); None when its module declares no names."""
    try:
        names = module_names(st.module)
    except NamesError as exc:
        raise CheckpointError(f"stage {st.index}: {exc}") from None
    if names is None:
        return None
    local: dict[int, list[str]] = {}
    for n, p in st.module.named_parameters(remove_duplicate=False):
        local.setdefault(id(p), []).append(n)
    params = [[names[n] for n in local.get(id(p), []) if n in names] for p in st.store.params]
    record: dict[str, Any] = {"names": names, "params": params}
    shards = _shards(parts, st, local)
    if shards:
        record["shards"] = shards
    tied = _carried(parts, st)
    if tied:
        record["tied"] = tied
    return record


def _shards(parts: PipelineParts, st: Stage, local: dict[int, list[str]]) -> dict[str, Shard]:
    """This rank's tensor-parallel pieces, by state_dict key."""
    tp = stage_tp(st.module)
    if tp is None:
        return {}
    from torch.distributed.tensor import Replicate, Shard as TorchShard

    at = getattr(parts.layout, "tp_rank", 0)
    out: dict[str, Shard] = {}
    for _owner, _name, param, mesh, placements, shape, _stride in tp.entries:
        if all(isinstance(p, Replicate) for p in placements):
            continue
        if len(placements) != 1 or not isinstance(placements[0], TorchShard):
            raise CheckpointError(
                f"stage {st.index}: a parameter with placements {placements} cannot be "
                "recorded in the model's names (Shard(d) or Replicate() on the tp mesh only)"
            )
        piece = {"dim": int(placements[0].dim), "of": int(mesh.size()), "at": int(at),
                 "shape": [int(d) for d in shape]}
        for key in local.get(id(param), []):
            out[key] = piece
    return out


def _carried(parts: PipelineParts, st: Stage) -> list[dict[str, Any]]:
    """Ties whose later holder is ``st`` on an asynchronous schedule (module docstring)."""
    naming = naming_of(st.module)
    out = []
    for g in parts.ties:
        if not getattr(g, "carried", False):
            continue
        owner = g.holders[0]
        for s, name in g.holders[1:]:
            if s == st.index and naming is not None:
                model_name = naming(name)
                if model_name is not None:
                    out.append({"name": model_name, "owner": [owner[0], owner[1]]})
    return out


def undeclared(parts: PipelineParts) -> list[int]:
    """The stages of ``parts`` whose modules declare no names (engine.model_names)."""
    return [st.index for st in parts.stages if naming_of(st.module) is None]


def needs_names(what: str, stages: list[int]) -> str:
    """Why ``what`` cannot be done with ``stages`` undeclared, and how to declare them."""
    return (
        f"{what} needs each stage's names in the whole model, but stage(s) {stages} of this "
        f"pipeline declare none (stages handed over as hand-made modules or factories); "
        f"{HOW_TO_DECLARE}"
    )
