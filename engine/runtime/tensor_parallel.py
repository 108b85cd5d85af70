"""DTensor stages in the engine: local shards in the arena, DTensors in the forward.

A stage factory shards its module with torch's ``parallelize_module`` (``ColwiseParallel``,
``RowwiseParallel``, ...) on the ``tp`` sub-mesh it receives (:mod:`engine.runtime.mesh`);
its parameters are then DTensors. The engine's machinery -- the flat arena buffers, version
slots, stashing, prediction, the fused optimizers -- works on plain dense tensors, and every
one of those operations is elementwise per parameter. So :func:`localize` turns each DTensor
parameter into a plain ``nn.Parameter`` holding **this rank's local shard** (same name, so
state dicts, fingerprints and checkpoints keep the module's names), and the stage module
gets a forward pre-hook that wraps each local parameter back into a DTensor with its
recorded mesh and placements (``DTensor.from_local``, no copy, no communication) for the
duration of the forward. Autograd flows through ``from_local``, so the local parameter's
``.grad`` -- a view into the arena's flat gradient buffer -- receives the local gradient.
Whatever buffer the weight store points the parameter at (a stashed version, a prediction)
is what the next forward wraps: every schedule and mitigation runs per shard.

What needs more than the shard (docs/ALGORITHMS.md, "Tensor parallelism"): gradient-norm
clipping sums |g|^p of sharded parameters over the ``tp`` group and counts replicated ones
once (:func:`reduce_norms`); Muon's orthogonalisation and BasisRotation's eigenbasis need the
whole matrix and are refused for sharded parameters (:func:`check_optimizer`).

Between stages: a stage output leaf that is a DTensor with replicated placements travels as
its local part (the full value) and arrives as a plain tensor; an ``AsyncCollectiveTensor``
(``use_local_output=True`` outputs) is waited for. Sharded or partial outputs are refused
with the leaf's name (redistribute to ``Replicate()`` or use ``use_local_output=True`` on a
row-wise last layer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineConfigError, PipelineInputError

__all__ = ["localize", "TensorParallelStage", "reduce_norms", "check_optimizer", "is_sharded"]


def _dtensor_types() -> tuple[type, ...]:
    from torch.distributed.tensor import DTensor

    return (DTensor,)


class TensorParallelStage:
    """What :func:`localize` recorded about one stage module: per local parameter, the mesh,
    placements, global shape and stride of its DTensor."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        #: (owner module, attribute name, local parameter, mesh, placements, shape, stride)
        self.entries: list[tuple[nn.Module, str, nn.Parameter, Any, tuple[Any, ...], Any, Any]] = []
        #: ids of local parameters whose placements shard them (not all Replicate)
        self.sharded: set[int] = set()
        self.mesh: Any = None

    def wrap(self, _module: nn.Module, _args: Any) -> None:
        """Forward pre-hook: each owner's attribute reads the DTensor view of its local shard."""
        from torch.distributed.tensor import DTensor

        for owner, name, local, mesh, placements, shape, stride in self.entries:
            dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
            owner.__dict__[name] = dt  # found before nn.Module.__getattr__'s _parameters

    def unwrap(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        """Forward hook: drop the DTensor views (the graph keeps what it saved) and make the
        output transportable."""
        for owner, name, *_ in self.entries:
            owner.__dict__.pop(name, None)
        return self.plain_output(output)

    def plain_output(self, output: Any) -> Any:
        from engine.runtime import trees

        return trees.map_tensors(lambda t: _plain(t, self.stage), output) if not isinstance(
            output, Tensor
        ) else _plain(output, self.stage)


def _plain(t: Tensor, stage: int, path: str = "output") -> Tensor:
    """A stage output leaf as a plain tensor (module docstring)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise PipelineInputError(
                f"stage {stage}'s {path} is a DTensor with placements {tuple(t.placements)}; "
                "only replicated DTensors travel between stages for now. Redistribute it to "
                "Replicate() (or use RowwiseParallel(use_local_output=True) / "
                "ColwiseParallel(output_layouts=Replicate())) before the stage returns"
            )
        t = t.to_local()
    if isinstance(t, AsyncCollectiveTensor):
        t = t * 1  # waits; differentiable (the transport needs a plain tensor)
    return t


def localize(module: nn.Module, stage: int) -> TensorParallelStage | None:
    """Replace ``module``'s DTensor parameters by plain local-shard parameters (module
    docstring); None when it has none. Refuses DTensor buffers (nothing in the engine would
    keep them sharded consistently)."""
    (DTensor,) = _dtensor_types()
    for name, b in module.named_buffers():
        if isinstance(b, DTensor):
            raise PipelineConfigError(
                f"stage {stage}'s buffer {name!r} is a DTensor; the engine keeps DTensor "
                "parameters only (register it as a plain buffer on every tensor-parallel rank)"
            )
    found = [
        (owner, name, p)
        for owner in module.modules()
        for name, p in list(owner._parameters.items())
        if p is not None and isinstance(p, DTensor)
    ]
    if not found:
        return None
    tp = TensorParallelStage(stage)
    done: dict[int, nn.Parameter] = {}  # a DTensor shared by two owners keeps one local
    for owner, name, p in found:
        local = done.get(id(p))
        if local is None:
            local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
            done[id(p)] = local
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise PipelineConfigError(
                f"stage {stage}'s parameter {name!r} is a DTensor on a {mesh.ndim}-D mesh; "
                "parallelize the stage on the 1-D tp sub-mesh its factory receives (tp_mesh)"
            )
        if tp.mesh is None:
            tp.mesh = mesh
        placements = tuple(p.placements)
        owner._parameters[name] = local
        tp.entries.append((owner, name, local, mesh, placements, p.shape, p.stride()))
        if is_sharded(placements):
            tp.sharded.add(id(local))
    module.register_forward_pre_hook(tp.wrap)
    module.register_forward_hook(tp.unwrap, always_call=True)
    module._engine_tp = tp  # type: ignore[assignment]  # read by reduce_norms' callers
    return tp


def is_sharded(placements: tuple[Any, ...]) -> bool:
    from torch.distributed.tensor import Replicate

    return not all(isinstance(p, Replicate) for p in placements)


def reduce_norms(params: list[Tensor], norms: list[Tensor], norm_type: float, group: Any) -> list[Tensor]:
    """Per-parameter gradient norms of whole (unsharded) parameters from this rank's shard
    norms: for a sharded parameter (sum over the tp group of norm^p)^(1/p) (max for inf), a
    replicated one as it is. One all-reduce for the stage."""
    import torch.distributed as dist

    sharded = [_sharded_param(p) for p in params]
    if not any(sharded) or group is None:
        return norms
    idx = [i for i, s in enumerate(sharded) if s]
    vec = torch.stack([norms[i] for i in idx])
    if math.isinf(norm_type):
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        whole = vec
    else:
        vec = vec.double() ** norm_type
        dist.all_reduce(vec, group=group)
        whole = (vec ** (1.0 / norm_type)).to(norms[0].dtype)
    out = list(norms)
    for k, i in enumerate(idx):
        out[i] = whole[k]
    return out


def _sharded_param(p: Tensor) -> bool:
    return bool(getattr(p, "_engine_sharded", False))


def mark_sharded(tp: TensorParallelStage) -> None:
    """Tag the local parameters whose DTensor was sharded (read by :func:`reduce_norms`)."""
    for _o, _n, local, *_ in tp.entries:
        local._engine_sharded = id(local) in tp.sharded  # type: ignore[attr-defined]


def check_optimizer(stage: int, opt: Any, tp: TensorParallelStage) -> None:
    """Refuse optimizers whose math needs a whole sharded matrix (module docstring)."""
    from engine.optim.basis_rotation import BasisRotation
    from engine.optim.muon import Muon

    if not tp.sharded:
        return
    names = [n for o, n, local, *_ in tp.entries if id(local) in tp.sharded]
    if isinstance(opt, Muon):
        two_d = [n for o, n, local, *_ in tp.entries if id(local) in tp.sharded and local.ndim >= 2]
        if two_d:
            raise PipelineConfigError(
                f"stage {stage}: Muon orthogonalises each 2-D parameter (Newton-Schulz on the "
                f"whole matrix), but {two_d} are tensor-parallel shards; the shard's "
                "orthogonalisation is not the matrix's. Use Adam/AdamW/SGD/NAdam for tensor-"
                "parallel stages (gathering each matrix per step is not implemented)"
            )
    if isinstance(opt, BasisRotation):
        raise PipelineConfigError(
            f"stage {stage}: BasisRotation rotates each matrix into its gradient's eigenbasis, "
            f"which needs the whole matrix, but {names} are tensor-parallel shards; use "
            "Adam/AdamW/SGD/NAdam for tensor-parallel stages"
        )


# ---------------------------------------------------------------------- build hooks (rank.py)


def localize_stages(modules: list[nn.Module], mine: list[int], layout: Any) -> list[TensorParallelStage | None]:
    """:func:`localize` every module this rank built; DTensor weights need a mesh with a
    ``tp`` dimension whose sub-mesh they live on."""
    tps = []
    for s, m in zip(mine, modules, strict=True):
        tp = localize(m, s)
        if tp is not None:
            want = getattr(layout, "tp_mesh", None)
            if want is None:
                raise PipelineConfigError(
                    f"stage {s} has DTensor parameters but the pipeline has no tensor-parallel "
                    "dimension; pass mesh=init_device_mesh(..., mesh_dim_names=('pp', 'tp')) "
                    "and shard the stage on the tp_mesh its factory receives"
                )
            if tp.mesh != want:
                raise PipelineConfigError(
                    f"stage {s}'s DTensor parameters live on {tp.mesh}, not on the pipeline "
                    f"mesh's tp sub-mesh {want}; parallelize the stage on the tp_mesh its "
                    "factory receives"
                )
            mark_sharded(tp)
        tps.append(tp)
    return tps


def finish_stages(pipe: Any, tps: list[TensorParallelStage | None], layout: Any) -> None:
    """After the stages exist: refuse whole-matrix optimizers for sharded stages and give
    the clipper the tp group (its norms need the shards' sum)."""
    for st, tp in zip(pipe.stages, tps, strict=True):
        if tp is not None and st.bridge is not None:
            check_optimizer(st.index, st.bridge.opt, tp)
    clipper = getattr(pipe._executor, "clipper", None)
    if clipper is not None and getattr(layout, "tp", 1) > 1:
        clipper.tp_group = layout.tp_group
    pipe.tensor_parallel = getattr(layout, "tp", 1)
