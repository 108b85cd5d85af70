"""One DeviceMesh for the pipeline, data-parallel and tensor-parallel dimensions.

``Pipeline(..., transport="gloo"|"nccl", mesh=init_device_mesh(..., mesh_dim_names=...))``
names up to three dimensions: ``pp`` (required: one position per pipeline rank), ``dp``
(data-parallel replicas) and ``tp`` (tensor parallelism inside a stage, through torch's
DTensor). A missing ``dp`` or ``tp`` dimension has size 1. Why one mesh: the 3-D layouts of
large runs (Megatron, torchtitan) put each dimension's ranks where the links suit it
(tensor parallelism inside a node), and torch's ``init_device_mesh`` already creates every
dimension's process groups, collectively and in one order on every rank. The engine uses
them as they are: under gloo the stage transport and the loss message on ``pp``'s groups
(under NCCL ``pp``'s groups carry device collectives, and the engine adds a gloo control group
and two channel groups per boundary for each pipeline, transport/layout.py), the gradient
all-reduce on ``dp``'s, and a stage factory that accepts a ``tp_mesh`` keyword is called with
its ``tp`` sub-mesh, so that the user shards the stage with torch's ``parallelize_module``
(what then happens to DTensor weights: :mod:`engine.runtime.tensor_parallel`).

``data_parallel=R`` without a mesh stays the 2-D layout of transport/layout.py (rank ``r``
runs stage ``r % S`` of replica ``r // S``); with a mesh the ranks are wherever the mesh puts
them, and :class:`MeshLayout` records every global rank's (stage, replica, tp rank).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from engine.errors import PipelineConfigError
from engine.runtime.setup.mesh_option import MESH_DIMS, check_mesh, mesh_sizes
from engine.runtime.ranks.transport.layout import Layout, pipeline_groups

__all__ = ["MESH_DIMS", "MeshLayout", "check_mesh", "mesh_layout", "with_tp_mesh"]

@dataclasses.dataclass(frozen=True)
class MeshLayout(Layout):
    """A :class:`Layout` taken from a DeviceMesh, with the tensor-parallel dimension."""

    tp: int = 1  # tensor-parallel degree
    tp_rank: int = 0  # this rank's position along ``tp``
    tp_mesh: Any = None  # the 1-D sub-mesh a stage factory receives
    tp_group: Any = None
    #: per global rank: (stage, replica, tp rank), so rank 0 can describe every rank
    places: tuple[tuple[int, int, int], ...] = ()

    def place_of(self, rank: int) -> tuple[int, int, int]:
        return self.places[rank]

    def pp_lines(self) -> list[list[int]]:
        """Every pipeline's global ranks (stage order), one list per (replica, tp rank), in
        the same order on every rank: for groups that must be created collectively."""
        lines: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for r, (stage, replica, tp_rank) in enumerate(self.places):
            lines.setdefault((replica, tp_rank), []).append((stage, r))
        return [[r for _, r in sorted(v)] for _, v in sorted(lines.items())]


def mesh_layout(mesh: Any, ranks: int, timeout: float | None = None) -> MeshLayout:
    """The layout of this rank for a pipeline of ``ranks`` pipeline ranks (stages, or ranks
    holding virtual stages) on ``mesh``."""
    sizes = mesh_sizes(mesh)
    if sizes["pp"] != ranks:
        raise PipelineConfigError(
            f"the mesh's pp dimension has size {sizes['pp']} but the pipeline has {ranks} "
            "stage ranks; make the pp dimension as long as the number of stages"
        )
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh  # global ranks, indexed by the dimensions in the mesh's order
    world = dist.get_world_size()
    places: list[tuple[int, int, int]] = [(0, 0, 0)] * world
    for idx in _indices(tuple(grid.shape)):
        r = int(grid[idx])
        pos = dict(zip(names, idx, strict=True))
        places[r] = (pos["pp"], pos.get("dp", 0), pos.get("tp", 0))
    rank = dist.get_rank()
    stage, replica, tp_rank = places[rank]

    def line(dim: str) -> tuple[tuple[int, ...], Any]:
        if dim not in names:
            return (rank,), None
        sub = mesh[dim]
        return tuple(int(r) for r in sub.mesh.tolist()), sub.get_group()

    pipe_ranks, pipe_group = line("pp")
    dp_ranks, dp_group = line("dp")
    tp_mesh = mesh["tp"] if "tp" in names else None
    lines: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, (st, rep, tpr) in enumerate(places):  # every pipeline, in one order on every rank
        lines.setdefault((rep, tpr), []).append((st, r))
    nccl = dist.get_backend() != "gloo"
    control, channels = pipeline_groups(
        [[r for _, r in sorted(v)] for _, v in sorted(lines.items())], rank, nccl, timeout
    )
    from engine.runtime.ranks.transport.control import world_group

    world_group(timeout)  # (collective when first made: here, at the same point on every rank)
    return MeshLayout(
        rank, world, ranks, sizes["dp"], stage, replica, pipe_ranks, pipe_group, dp_ranks,
        dp_group if sizes["dp"] > 1 else None, control_group=control if nccl else pipe_group,
        channel_groups=channels, tp=sizes["tp"], tp_rank=tp_rank, tp_mesh=tp_mesh,
        tp_group=None if tp_mesh is None else tp_mesh.get_group(), places=tuple(places),
    )


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (k,) for i in out for k in range(n)]
    return out


def takes_tp_mesh(factory: Any) -> bool:
    """Whether a stage factory names a ``tp_mesh`` parameter (a ``**kwargs`` is not enough:
    module classes such as ``nn.Tanh`` take those and refuse the keyword)."""
    if isinstance(factory, nn.Module) or not callable(factory):
        return False
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "tp_mesh" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    )


def with_tp_mesh(spec: Any, layout: Layout) -> Any:
    """The stage spec to build: a factory that accepts ``tp_mesh`` gets this rank's ``tp``
    sub-mesh (None without a ``tp`` dimension); anything else is built as it is."""
    if not isinstance(layout, MeshLayout) or not takes_tp_mesh(spec):
        return spec  # (without a mesh every factory is called as before)
    tp_mesh = layout.tp_mesh
    call: Callable[[], nn.Module] = lambda: spec(tp_mesh=tp_mesh)  # noqa: E731
    call.__name__ = getattr(spec, "__name__", type(spec).__name__)  # type: ignore[attr-defined]
    return call


def refuse_with_mesh(virtual: bool, tied: Any, stages: Any) -> None:
    """What the mesh layout does not carry yet, refused before any group exists."""
    if virtual:
        raise PipelineConfigError(
            "mesh= with virtual stages (interleaved) is not supported yet: the virtual "
            "transports are wired for the 2-D layout; use data_parallel= or a non-interleaved "
            "schedule"
        )
    if tied or (not callable(stages) and isinstance(stages, (list, tuple))
                and all(isinstance(m, nn.Module) for m in stages) and _shares(stages)):
        raise PipelineConfigError(
            "mesh= with tied parameters is not supported yet: the tie groups are wired for the "
            "2-D layout (rank = replica * stages + stage); untie them or use data_parallel="
        )


def _shares(modules: Any) -> bool:
    seen: dict[int, int] = {}
    for s, m in enumerate(modules):
        for p in m.parameters():
            if seen.setdefault(id(p), s) != s:
                return True
    return False
