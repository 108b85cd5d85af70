"""Tied parameters: one ``nn.Parameter`` used by several stages (a language model's token
embedding and its output head).

Why copies: each stage keeps its weights in its own arena (flat buffers, version slots), so
one tensor cannot live in two stages. The first stage that holds a tied parameter keeps the
original; every other holder gets its own copy with the same values (:func:`untie`). The
copies stay bitwise equal because they take the same steps: before the update phase of a
synchronous step the holders' gradients are summed (:class:`TiedGradients`; under gloo/NCCL
an all-reduce over a process group of just the holders' ranks), and every holder's
optimizer applies that sum -- exactly the gradient autograd accumulates into the one
parameter of the unpipelined model. Each holder's optimizer must therefore treat the tied
parameter alike (the same factory does).

Stage factories (the way to build only a rank's own stage) cannot share an ``nn.Parameter``:
each builds its own. A tie between factory-built stages is declared instead,
``Pipeline(..., ties=[["0:tok.weight", "3:head.weight"]])`` (stage:parameter name in that
stage's module; :func:`declared_ties`): every holder must have that parameter, with the same
shape and dtype on every rank (checked at build time, on every rank), and every holder starts
from the owner's (the first holder's) values, so the pipeline trains the tied model. An
undeclared tie cannot be seen across factories; the README says to declare it.

A module handed to several stages (a head that calls ``F.linear(h, emb.weight)`` on the
embedding module the first stage also holds) is the same tie: every later stage gets its own
copy of that module's structure holding the *same* parameters (:func:`separate_modules`), so
the tie becomes a shared parameter and is trained as one.

Asynchronous schedules keep no copies: the tied parameter lives at its owner only, and the
value the owner's forward read travels with the micro-batch to the other holders, whose
gradient travels back to the owner (engine/runtime/ties/carry.py; docs/ALGORITHMS.md, "Tied
parameters").
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineConfigError

__all__ = [
    "TieGroup", "find_ties", "untie", "tie_stages", "connect_ties", "TiedGradients",
    "declared_ties", "start_tied", "with_declared", "broadcast_owner", "separate_modules",
]


@dataclass
class TieGroup:
    """The holders of one tied parameter: (stage, parameter name in that stage's module),
    the owner (lowest stage) first."""

    holders: list[tuple[int, str]]
    process_group: Any = field(default=None, repr=False)
    #: asynchronous schedules: the owner's value travels with each micro-batch (tie_carry.py)
    carried: bool = field(default=False, repr=False)

    @property
    def stages(self) -> list[int]:
        return [s for s, _ in self.holders]

    def describe(self) -> str:
        return ", ".join(f"stage {s} {name!r}" for s, name in self.holders)


def find_ties(modules: list[nn.Module]) -> list[TieGroup]:
    """Parameters that appear in more than one stage, in a deterministic order (every rank
    finds the same groups); refuses a parameter whose memory a buffer of a stage also uses."""
    owner_of: dict[int, int] = {}
    for s, m in enumerate(modules):
        for sub in m.modules():
            first = owner_of.setdefault(id(sub), s)
            if first != s:
                raise PipelineConfigError(  # separate_modules ran first: a guard
                    f"stage {s} and stage {first} share the module object {type(sub).__name__}"
                )
    where: dict[int, list[tuple[int, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, m in enumerate(modules):
        seen: set[int] = set()
        for name, p in m.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            where.setdefault(id(p), []).append((s, name))
            params[id(p)] = p
    groups = [TieGroup(h) for h in where.values() if len({s for s, _ in h}) > 1]
    spans = {
        id(p): (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
        for p in params.values() if p.numel() > 0 and p.device.type != "meta"
    }
    for s, m in enumerate(modules):
        for bname, b in m.named_buffers():
            if b is None or b.numel() == 0 or b.device.type == "meta":
                continue
            lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
            for pid, (plo, phi) in spans.items():
                if lo < phi and plo < hi:
                    owner = where[pid][0]
                    raise PipelineConfigError(
                        f"stage {s} buffer {bname!r} shares memory with parameter {owner[1]!r} "
                        f"of stage {owner[0]}: a parameter can be tied only to parameters "
                        "(register the shared tensor as an nn.Parameter in both places, or "
                        "give the buffer its own copy)"
                    )
    return groups


def untie(modules: list[nn.Module], groups: list[TieGroup], stages: list[int] | None = None) -> None:
    """Give every holder but the owner its own copy of the tied parameter (same values and
    requires_grad), in place of every reference to it inside that stage's module; only the
    stages in ``stages`` when given (a rank builds only its own)."""
    for g in groups:
        if g.carried:  # asynchronous: no copies (tie_carry.py)
            continue
        owner_stage, owner_name = g.holders[0]
        original = dict(modules[owner_stage].named_parameters())[owner_name]
        for s, _ in g.holders[1:]:
            if stages is not None and s not in stages:
                continue
            copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for sub in modules[s].modules():
                for key, value in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
                    if value is original:
                        setattr(sub, key, copy)  # (re-registers the parameter under its name)


def declared_ties(ties: Any, S: int) -> list[TieGroup]:
    """Parse ``Pipeline(ties=...)``: a list of groups, each a list of ``"stage:name"`` (or
    ``(stage, name)``) holders of one parameter on at least two stages; the lowest stage owns it."""
    if ties is None:
        return []
    if isinstance(ties, (str, bytes)) or not hasattr(ties, "__iter__"):
        raise PipelineConfigError(
            f"ties={ties!r}: give a list of groups, each a list of 'stage:parameter' names, "
            "e.g. ties=[['0:tok.weight', '3:head.weight']]"
        )
    groups = []
    for g in ties:
        holders: list[tuple[int, str]] = []
        items = [g] if isinstance(g, str) else list(g) if hasattr(g, "__iter__") else [g]
        for h in items:
            if isinstance(h, str) and ":" in h and h.split(":", 1)[0].strip().isdigit():
                stage, name = int(h.split(":", 1)[0]), h.split(":", 1)[1].strip()
            elif isinstance(h, (tuple, list)) and len(h) == 2 and isinstance(h[0], int) and isinstance(h[1], str):
                stage, name = h[0], h[1]
            else:
                raise PipelineConfigError(
                    f"ties: holder {h!r} of group {g!r} is not 'stage:parameter' (e.g. "
                    "'3:head.weight') or (stage, 'parameter')"
                )
            if not 0 <= stage < S or not name:
                raise PipelineConfigError(
                    f"ties: holder {h!r} names stage {stage}, but the pipeline has stages 0..{S - 1}"
                )
            if (stage, name) in holders:
                raise PipelineConfigError(f"ties: group {g!r} names {h!r} twice")
            holders.append((stage, name))
        if len({s for s, _ in holders}) < 2:
            raise PipelineConfigError(
                f"ties: group {g!r} must name a parameter on at least two different stages"
            )
        groups.append(TieGroup(sorted(holders)))
    seen: dict[tuple[int, str], int] = {}
    for k, grp in enumerate(groups):
        for h in grp.holders:
            if h in seen:
                raise PipelineConfigError(f"ties: stage {h[0]} {h[1]!r} is in groups {seen[h]} and {k}")
            seen[h] = k
    return groups


def _holder(modules: dict[int, nn.Module], s: int, name: str) -> nn.Parameter:
    params = dict(modules[s].named_parameters())
    if name not in params:
        near = [n for n in params if n.split(".")[-1] == name.split(".")[-1]][:5]
        hint = f" (parameters with that last name: {near})" if near else f" (it has {sorted(params)[:8]})"
        raise PipelineConfigError(f"ties: stage {s} has no parameter {name!r}{hint}")
    return params[name]


def start_tied(
    groups: list[TieGroup], modules: dict[int, nn.Module], spec: Any
) -> dict[int, tuple[list[int], str]]:
    """Check declared ties against the stages built here (stage -> module): every holder has
    the parameter with one shape and dtype, and holders here start from the owner's values when the owner is here too.
    Returns, per group index, the (shape, dtype) of its holders here: under gloo/NCCL every
    rank compares it with the other holders' ranks (agreement.py), then the owner's values
    are broadcast to them (:func:`broadcast_owner`)."""
    shapes: dict[int, tuple[list[int], str]] = {}
    for k, g in enumerate(groups):
        names = dict(g.holders)
        here = [(s, _holder(modules, s, n)) for s, n in g.holders if s in modules]
        for (s, p), (s0, p0) in zip(here[1:], here[:-1], strict=True):
            if p.shape != p0.shape or p.dtype != p0.dtype:
                raise PipelineConfigError(
                    f"ties: stage {s0} {names[s0]!r} is {tuple(p0.shape)} {p0.dtype}, stage {s} "
                    f"{names[s]!r} is {tuple(p.shape)} {p.dtype}: tied parameters must have "
                    "the same shape and dtype"
                )
        if here:
            shapes[k] = (list(here[0][1].shape), str(here[0][1].dtype))
            if here[0][0] == g.holders[0][0]:  # the owner is here: the others start from it
                with torch.no_grad():
                    for _, p in here[1:]:
                        p.copy_(here[0][1])
    return shapes


def with_declared(
    found: list[TieGroup], ties: Any, spec: Any, modules: dict[int, nn.Module]
) -> tuple[list[TieGroup], list[TieGroup], dict[str, Any]]:
    """The pipeline's tie groups: those ``found`` by identity plus the declared ones
    (``Pipeline(ties=...)``) not found already. Returns (all groups, the declared ones added,
    the settings every holder's rank must agree on: each added group's shape and dtype)."""
    known = [set(g.holders) for g in found]
    added = [g for g in declared_ties(ties, spec.stages) if set(g.holders) not in known]
    shapes = start_tied(added, modules, spec)
    agree = {f"the shape and dtype of tied {added[k].describe()}": v for k, v in shapes.items()}
    groups = found + added
    if groups and not spec.synchronous:  # the owner's value travels with the micro-batch
        from engine.runtime.ties.carry import carry_ties

        carry_ties(groups, modules, spec)
    return groups, added, agree


def broadcast_owner(groups: list[TieGroup], modules: dict[int, nn.Module], owner_rank: Any) -> None:
    """Under gloo/NCCL: the declared holders on other ranks take the owner's values (one
    broadcast per group over the holders' process group); ``owner_rank(stage)`` is the
    global rank of this replica's ``stage``."""
    for g in groups:
        if g.carried:  # asynchronous: only the owner holds it (tie_carry.py)
            continue
        here = [_holder(modules, s, n) for s, n in g.holders if s in modules]
        if g.process_group is None or not here:
            continue
        buf = here[0].detach().clone()
        torch.distributed.broadcast(buf, owner_rank(g.holders[0][0]), group=g.process_group)
        with torch.no_grad():
            for p in here:
                p.copy_(buf)


def separate_modules(modules: list[nn.Module]) -> None:
    """A submodule handed to several stages (a head that reads the embedding module's weight)
    runs in one stage only: every later stage gets its own copy of its structure holding the
    *same* parameters and buffers, so that :func:`find_ties` sees an ordinary shared
    parameter (the tie it means). Refused: a whole stage that is another stage's module, and
    a shared module whose forward updates its buffers (BatchNorm's running statistics would
    be updated once per holding stage, not once as in the unpipelined model)."""
    seen: dict[int, int] = {}
    for s, m in enumerate(modules):
        if id(m) in seen:
            raise PipelineConfigError(
                f"stage {s} is the module of stage {seen[id(m)]} ({type(m).__name__}): a stage "
                "runs its own module; to tie weights, let the later stage hold a module that "
                "uses the shared one (or its parameter)"
            )
        _separate(m, seen, s, type(m).__name__)
        for sub in m.modules():
            seen.setdefault(id(sub), s)


def _separate(parent: nn.Module, seen: dict[int, int], s: int, path: str) -> None:
    children = [(n, c) for n, c in parent.named_modules(remove_duplicate=False) if n and "." not in n]
    for name, child in children:
        if id(child) not in seen:
            _separate(child, seen, s, f"{path}.{name}")
            continue
        for sub in child.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
                raise PipelineConfigError(
                    f"stage {s} ({path}.{name}) and stage {seen[id(child)]} share the module "
                    f"{type(child).__name__}, which holds {type(sub).__name__} running "
                    "statistics: each stage would update them. Share only the parameters "
                    "(e.g. head.weight = embedding.weight)"
                )
        keep = {id(t): t for t in [*child.parameters(), *child.buffers()]}
        setattr(parent, name, copy.deepcopy(child, memo=keep))  # same tensors, own structure


def tie_stages(modules: list[nn.Module], spec: Any, stages: list[int] | None = None) -> list[TieGroup]:
    """Find parameters shared across stages (also through a shared module:
    :func:`separate_modules`) and, on synchronous schedules, give every holder but the
    first its own copy (only in ``stages`` when given); asynchronous schedules carry the
    owner's value instead (marked here, set up by :func:`with_declared`)."""
    separate_modules(modules)
    groups = find_ties(modules)
    for g in groups:
        g.carried = not spec.synchronous
    untie(modules, groups, stages)
    return groups


def connect_ties(
    groups: list[TieGroup],
    stages: int,
    replicas: int,
    stage: int,
    replica: int,
    rank_of: Callable[[int], int] | None = None,
    timeout: float | None = None,
) -> None:
    """One process group per tie group and replica (``timeout``: each group's, seconds): the
    holders' ranks (global rank
    ``replica * stages + stage``). ``new_group`` is collective over the world, so every rank
    creates every group in the same order and keeps the one it belongs to.

    With virtual stages ``stages`` is the number of ranks R and ``stage`` this rank: holder
    s runs on rank s % R, and a rank holding several holders sums them before the all-reduce
    (:class:`TiedGradients`); holders all on one rank need no group. ``rank_of``: the rank
    of a stage under another placement (the V puts stages 0 and 2R-1 on rank 0)."""
    where = rank_of or (lambda s: s % stages)
    for g in groups:
        if g.carried:  # the value travels between stages: no group (tie_carry.py)
            continue
        ranks = sorted({where(s) for s in g.stages})
        if len(ranks) < 2:
            continue
        for r in range(replicas):
            pg = torch.distributed.new_group(
                [r * stages + x for x in ranks],
                timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
            )
            if r == replica and stage in ranks:
                g.process_group = pg


class TiedGradients:
    """Sums the holders' gradients of every tie group before a synchronous update phase."""

    def __init__(self, groups: list[TieGroup], stages: list[Any]) -> None:
        self.groups = groups
        by_index = {st.index: st for st in stages}
        #: per group: (store, parameter, its index in the store) of each holder present here
        self._local: list[list[tuple[Any, nn.Parameter, int]]] = []
        for g in groups:
            present = []
            if g.carried:  # asynchronous: the owner's update applies the sum (tie_carry.py)
                self._local.append(present)
                continue
            for s, name in g.holders:
                st = by_index.get(s)
                if st is not None:
                    p = dict(st.module.named_parameters())[name]
                    present.append((st.store, p, st.store.index_of(p)))
            self._local.append(present)

    def reduce(self) -> None:
        """grad <- sum over holders, in every holder; a holder whose copy received no
        gradient this step counts as zero, and all holders then step (as the one parameter
        of the unpipelined model would)."""
        with torch.no_grad():
            for g, present in zip(self.groups, self._local, strict=True):
                if not present or not present[0][1].requires_grad:
                    continue
                for store, _, _ in present:
                    store.settle_grads()  # a holder no backward wrote this step: zeros
                grads = [p.grad for _, p, _ in present]
                if any(t is None for t in grads):
                    raise PipelineConfigError(
                        f"tied parameter ({g.describe()}) has no gradient buffer in a holder"
                    )
                used = [store.was_used(i) for store, _, i in present]
                total: Tensor = grads[0].clone() if used[0] else torch.zeros_like(grads[0])
                for t, u in zip(grads[1:], used[1:], strict=True):
                    if u:
                        total.add_(t)
                if g.process_group is not None:
                    # on the gradients' device: an NCCL tie group carries device tensors only
                    any_used = torch.tensor([float(any(used))], device=total.device)
                    torch.distributed.all_reduce(total, group=g.process_group)
                    torch.distributed.all_reduce(any_used, group=g.process_group)
                    if any_used.item() == 0.0:
                        continue
                elif not any(used):
                    continue
                for store, p, i in present:
                    p.grad.copy_(total)
                    store.mark_used(i)
