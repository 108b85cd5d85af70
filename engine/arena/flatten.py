"""``flatten_``: validate a stage's parameters, then move them into a new arena in one go.

Why validation and commit are split: a parameter list that cannot go into an arena (mixed
devices, integer dtypes, a parameter another arena owns, ...) must raise before any tensor
moves, so a failed call leaves the model exactly as it was. The C++ side only copies; the
one irreversible step (re-pointing ``p.data``/``p.grad``) runs after every check passed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.arena.core import DEFAULT_ALIGNMENT, ArenaError, _check_alignment, _core_module
from engine.arena.registry import _owner_of, register
from engine.arena.views import FlatView
from engine.arena.weight_arena import WeightArena, _Bucket

_ARENA_COUNTER = itertools.count()

ParamsLike = nn.Module | torch.Tensor | Iterable[Any]


def _collect(module_or_params: ParamsLike) -> list[tuple[str, torch.Tensor, int]]:
    """(qualified name, tensor, param group) for every parameter, in arena order."""
    if isinstance(module_or_params, nn.Module):
        return [(n, p, 0) for n, p in module_or_params.named_parameters()]
    if isinstance(module_or_params, torch.Tensor):
        return [("params[0]", module_or_params, 0)]
    if isinstance(module_or_params, (str, bytes)) or not isinstance(module_or_params, Iterable):
        raise TypeError(
            "flatten_ takes an nn.Module, an iterable of parameters, of (name, parameter) "
            f"pairs, or of param-group dicts; got {type(module_or_params).__name__}"
        )
    items = list(module_or_params)
    out: list[tuple[str, torch.Tensor, int]] = []
    if items and all(isinstance(x, dict) for x in items):
        for g, group in enumerate(items):
            if "params" not in group:
                raise TypeError(f"param group {g} has no 'params' entry")
            ps = group["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            for i, p in enumerate(ps):
                if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                    out.append((p[0], p[1], g))
                else:
                    out.append((f"param_groups[{g}].params[{i}]", p, g))
        return out
    for i, x in enumerate(items):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            out.append((x[0], x[1], 0))
        else:
            out.append((f"params[{i}]", x, 0))
    return out


def check_weight_dtype(name: str, p: torch.Tensor) -> None:
    """Raise an ArenaError naming ``name`` unless ``p`` is a real floating-point tensor.

    The pipeline checks this before it calls a stage's optimizer factory, so that the error
    names the parameter whatever optimizer refuses the dtype first."""
    if not p.dtype.is_floating_point:
        kind = "complex" if p.dtype.is_complex else "integer/bool"
        raise ArenaError(
            f"parameter {name!r} has {kind} dtype {p.dtype}; the arena holds real "
            "floating-point weights only (optimizers update them in place). Keep such "
            "tensors as buffers (module.register_buffer) or convert them (p.float())"
        )


def _validate(entries: list[tuple[str, torch.Tensor, int]], arena_name: str) -> torch.device | None:
    seen: dict[int, str] = {}
    first: tuple[str, torch.device] | None = None
    for name, p, _group in entries:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch.Tensor")
        if id(p) in seen:
            raise ArenaError(
                f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; list each "
                "parameter once (tied weights appear once in module.parameters())"
            )
        seen[id(p)] = name
        if not p.is_leaf:
            raise ArenaError(
                f"parameter {name!r} is not a leaf tensor (it was computed from other "
                "tensors); pass the nn.Parameter itself"
            )
        if p.layout != torch.strided:
            raise ArenaError(
                f"parameter {name!r} has layout {p.layout}; the arena holds dense tensors only"
            )
        check_weight_dtype(name, p)
        if first is None:
            first = (name, p.device)
        elif p.device != first[1]:
            raise ArenaError(
                f"parameter {name!r} is on {p.device} but {first[0]!r} is on {first[1]}; one "
                f"stage (arena {arena_name!r}) lives on one device: move the module there "
                "first (module.to(device)) or split it into one stage per device"
            )
        owner = _owner_of(p)
        if owner is not None:
            raise ArenaError(
                f"parameter {name!r} already belongs to arena {owner.name!r}, so it cannot "
                f"also go into arena {arena_name!r}: a parameter shared by two stages would "
                "be updated by both. Give each stage its own copy (copy.deepcopy) or put "
                "its users in the same stage"
            )
    return None if first is None else first[1]


def flatten_(
    module_or_params: ParamsLike,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    name: str | None = None,
) -> WeightArena:
    """Move a stage's parameters into a new :class:`WeightArena`, in place.

    ``module_or_params``: an ``nn.Module`` (its ``named_parameters()``; errors then name
    parameters by their qualified names), an iterable of tensors or of (name, tensor)
    pairs, or a list of param-group dicts (``{"params": [...]}``; each group gets its own
    buckets, as optimizers treat groups separately). Parameters are grouped into buckets by
    (device, dtype, param group, requires_grad); each tensor's slice starts at a multiple of
    ``alignment`` bytes (a power of two). Every ``nn.Parameter`` object is kept; its
    ``.data`` becomes a view of the flat buffer and, for requires_grad parameters, its
    ``.grad`` a view of the flat gradient buffer (an existing gradient is copied in).

    Everything is validated before any tensor moves: mixed devices, non-floating dtypes,
    non-leaf or sparse tensors, duplicates, parameters another arena owns, and a bad
    ``alignment`` raise :class:`ArenaError` (or TypeError) and leave the input untouched.

    On CUDA the fill and copy into the flat buffers are queued on the current stream, as any
    torch op: before another stream touches the weights (snapshots on it included, whose
    copy waits only for that stream) order it after this one, e.g.
    ``s.wait_stream(torch.cuda.current_stream())``. A ``torch.cuda.Stream()`` is
    non-blocking, so nothing else orders it after the default stream.
    """
    _check_alignment(alignment)
    arena_name = name if name is not None else f"arena{next(_ARENA_COUNTER)}"
    entries = _collect(module_or_params)
    device = _validate(entries, arena_name)

    core_mod = _core_module()
    core = core_mod.Arena(alignment)
    arena = WeightArena(
        _core=core, name=arena_name, alignment=alignment, device=device or torch.device("cpu")
    )

    # Group into buckets in order of first appearance; nothing has moved yet, and the
    # C++ side only copies, so a failure here still leaves the parameters as they were.
    keys: dict[tuple[str, torch.dtype, int, bool], list[int]] = {}
    for idx, (_n, p, group) in enumerate(entries):
        keys.setdefault((str(p.device), p.dtype, group, bool(p.requires_grad)), []).append(idx)
    built = []
    for b, ((_dev, dtype, group, rg), members) in enumerate(keys.items()):
        tensors = [entries[i][1].detach() for i in members]
        index = int(core.add_bucket(tensors, group, rg))
        assert index == b
        live = list(core.param_views(b))
        grads = list(core.grad_views(b)) if rg else []
        built.append((b, dtype, group, rg, members, live, grads))

    # Commit: re-point every parameter (cannot fail after the checks above).
    place: list[tuple[int, int]] = [(0, 0)] * len(entries)
    with torch.no_grad():
        for b, dtype, group, rg, members, live, grads in built:
            params = [entries[i][1] for i in members]
            for pos, (i, p) in enumerate(zip(members, params, strict=False)):
                old_grad = p.grad
                p.data = live[pos]
                if rg:
                    if old_grad is not None:
                        grads[pos].copy_(old_grad)
                    p.grad = grads[pos]
                place[i] = (b, pos)
            ptrs = [v.data_ptr() for v in live] if live[0].device.type != "meta" else [0] * len(live)
            grad_ptrs = (
                [v.data_ptr() for v in grads] if rg and grads[0].device.type != "meta" else [0] * len(grads)
            )
            flat_grad = core.bucket_grad(b)
            view = FlatView(
                param=core.bucket_param(b),
                grad=flat_grad,
                offsets=[int(o) for o in core.bucket_offsets(b)],
                numels=[int(n) for n in core.bucket_numels(b)],
                params=tuple(params),
                shapes=tuple(p.shape for p in params),
                alignment=alignment,
                _grad_views=tuple(grads),
                _grad_ptrs=tuple(grad_ptrs),
            )
            arena._buckets.append(
                _Bucket(
                    index=b,
                    device=params[0].device,
                    dtype=dtype,
                    group=group,
                    requires_grad=rg,
                    params=params,
                    names=[entries[i][0] for i in members],
                    positions=list(members),
                    live_views=live,
                    grad_views=grads,
                    ptrs=ptrs,
                    grad_ptrs=grad_ptrs,
                    flat_view=view,
                )
            )
    arena.params = [p for _n, p, _g in entries]
    arena.names = [n for n, _p, _g in entries]
    arena._place = place

    register(arena)
    return arena
