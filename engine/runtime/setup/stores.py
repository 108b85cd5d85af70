"""Building a pipeline's stages: modules, optimizers, weight arenas, stores.

Why this order (module, then optimizer, then arena): the arena keeps a stage's weights in one
flat buffer per *bucket*, and an optimizer step is one fused launch per bucket only when a
bucket holds exactly the parameters of one optimizer param group. So the optimizer factory
is called first (on temporary parameters sharing the module's storage), its param groups
decide the buckets, the module is flattened into an arena grouped that way, and the
optimizer's parameters -- the stage's *shadow* parameters -- are re-pointed at the arena's
live buffer. Weight decay groups (no decay for biases and norms) thus keep their fused path.

One sequential splitter: an ``nn.Sequential`` with ``balance`` is cut by
:func:`engine.partition.split_sequential`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.errors import ArenaError, PipelineConfigError
from engine.runtime.stage.optim_bridge import OptimizerBridge
from engine.runtime.stage.weight_store import WeightStore

__all__ = ["StageSpec", "resolve_stage_specs", "build_module", "build_store"]

StageSpec = nn.Module | Callable[[], nn.Module]


def resolve_stage_specs(stages: Any, balance: Any) -> list[StageSpec]:
    """One module or factory per stage, from a list, or an nn.Sequential cut by ``balance``."""
    if isinstance(stages, nn.Sequential) and balance is not None:
        from engine.partition import split_sequential

        try:
            return list(split_sequential(stages, balance))
        except (ValueError, TypeError) as exc:
            raise PipelineConfigError(str(exc)) from None
    if balance is not None:
        raise PipelineConfigError("balance is only used with an nn.Sequential `stages`")
    if isinstance(stages, nn.Module):
        raise PipelineConfigError(
            "stages must be a list of nn.Module (one per stage), a list of factories "
            "() -> nn.Module, or an nn.Sequential with balance=[...]"
        )
    try:
        specs = list(stages)
    except TypeError:
        raise PipelineConfigError(
            f"stages must be a list of nn.Module or of factories, got {type(stages).__name__}"
        ) from None
    if not specs:
        raise PipelineConfigError("stages is empty; pass at least one nn.Module")
    for s, m in enumerate(specs):
        if not isinstance(m, nn.Module) and not callable(m):
            raise PipelineConfigError(
                f"stage {s} is a {type(m).__name__}, not an nn.Module or a factory () -> nn.Module"
            )
    return specs


def build_module(spec: StageSpec, s: int) -> nn.Module:
    """The module of stage ``s``: the module itself, or what its factory returns."""
    m = spec
    if not isinstance(spec, nn.Module):
        try:
            m = spec()
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
                # raised by the call itself (arguments), not inside a factory's body
                name = getattr(spec, "__name__", None) or type(spec).__name__
                raise PipelineConfigError(
                    f"stage {s} is not a module or a factory: {name} cannot be called with no "
                    f"arguments ({exc}); pass an nn.Module, or a factory () -> nn.Module (to "
                    "use a function as a layer, wrap it in a module)"
                ) from None
            raise
        if not isinstance(m, nn.Module):
            raise PipelineConfigError(
                f"the factory of stage {s} returned {type(m).__name__}; it must return an nn.Module"
            )
    assert isinstance(m, nn.Module)
    if isinstance(m, nn.Sequential) and len(m) == 0:
        raise PipelineConfigError(
            f"stage {s} is an empty nn.Sequential: more stages than layers; use fewer stages"
        )
    return m


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def build_store(
    module: nn.Module,
    s: int,
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    cuda_graphs: bool | str = False,
) -> tuple[WeightStore, OptimizerBridge | None]:
    """The weight store and optimizer bridge of stage ``s`` (module docstring).
    ``cuda_graphs``: refuse an optimizer or device the graphs cannot capture before the
    module's parameters move into an arena."""
    from engine.arena import flatten_
    from engine.arena.flatten import check_weight_dtype

    named = _unique_params(module)
    if not named:
        return WeightStore(None, [], []), None
    try:  # before the factory: an optimizer refusing the dtype would name params[j] only
        for name, p in named:
            check_weight_dtype(name, p)
    except ArenaError as exc:
        raise PipelineConfigError(f"stage {s}: {exc}") from None
    temp = [nn.Parameter(p.data, requires_grad=p.requires_grad) for _, p in named]
    opt = factory(temp)
    if not isinstance(opt, torch.optim.Optimizer):
        raise PipelineConfigError(
            f"stage {s}: the optimizer factory returned {type(opt).__name__}; it must return a "
            "torch.optim.Optimizer (e.g. optimizer=lambda params: engine.optim.SGD(params, lr=0.1))"
        )
    if cuda_graphs:
        from engine.runtime.capture.synchronous import optimizer_refusal

        reason = optimizer_refusal(s, opt, named[0][1].device, cuda_graphs)
        if reason is not None:
            raise PipelineConfigError(reason)
    where = {id(t): i for i, t in enumerate(temp)}
    groups: list[list[int]] = []
    placed: set[int] = set()
    for g, group in enumerate(opt.param_groups):
        members = []
        for t in group["params"]:
            i = where.get(id(t))
            if i is None:
                raise PipelineConfigError(
                    f"stage {s}: param group {g} of the stage optimizer holds a tensor that is "
                    "not one of the parameters the pipeline passed to the optimizer factory; "
                    "build it from the params argument"
                )
            if i not in placed:
                placed.add(i)
                members.append(i)
        groups.append(members)
    rest = [i for i in range(len(temp)) if i not in placed]
    if rest:
        groups.append(rest)
    order = [i for members in groups for i in members]
    arena_groups = [{"params": [named[i] for i in members]} for members in groups if members]
    try:
        arena = flatten_(arena_groups, name=f"stage{s}")
    except ArenaError as exc:
        raise PipelineConfigError(f"stage {s}: {exc}") from None
    params = [named[i][1] for i in order]
    shadow = [temp[i] for i in order]
    store = WeightStore(arena, params, shadow)
    bridge = OptimizerBridge(opt, shadow)
    bridge.bind(store)
    return store, bridge

