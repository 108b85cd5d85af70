"""DTensor stages in the engine: local shards in the arena, DTensors in the forward.

A stage factory shards its module with torch's ``parallelize_module`` (``ColwiseParallel``,
``RowwiseParallel``, ...) on the ``tp`` sub-mesh it receives (:mod:`engine.runtime.ranks.mesh`);
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

Between stages (:func:`connect_transport`): each output leaf that is a DTensor travels as
this rank's local part to the same tp rank of the next stage, which receives a DTensor again
(``DTensor.from_local`` with the same placements; shards split evenly, as ``from_local``
assumes); plain leaves stay plain (an ``AsyncCollectiveTensor`` is waited for). The
placements are agreed at the handshake: stage s's dry run fixes its output leaves'
placements and sends them right after its Signature; a later output with other placements
is refused naming the leaf and both placements. Partial sums cannot travel (reduce first),
and the last stage's output must be replicated (``loss_fn`` sees the whole value).
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineConfigError, PipelineInputError

__all__ = [
    "localize", "TensorParallelStage", "reduce_norms", "check_optimizer", "is_sharded",
    "stage_tp", "input_placements",
]

#: what :func:`localize` found per stage module, what :func:`connect_transport` agreed per
#: receiving module, and the local parameters whose DTensor was sharded (by id: a tensor's
#: ``==`` is elementwise, so tensors cannot key a weak set). Registries rather than attributes
#: written onto the user's modules and tensors.
_TP_OF: weakref.WeakKeyDictionary[nn.Module, TensorParallelStage] = weakref.WeakKeyDictionary()
_INPUTS_OF: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
_SHARDED: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def stage_tp(module: nn.Module) -> TensorParallelStage | None:
    """What :func:`localize` recorded for a stage module (None: no DTensor weights)."""
    return _TP_OF.get(module)


def input_placements(module: nn.Module) -> Any:
    """The input placements agreed at the handshake for a receiving stage module (or None)."""
    return _INPUTS_OF.get(module)


def _dtensor_types() -> tuple[type, ...]:
    from torch.distributed.tensor import DTensor

    return (DTensor,)


class TensorParallelStage:
    """What :func:`localize` recorded about one stage module: per local parameter, the mesh,
    placements, global shape and stride of its DTensor; and the placements of its output."""

    def __init__(self, stage: int, last: bool = False) -> None:
        self.stage = stage
        self.last = last  # the last stage: its output meets loss_fn, which needs whole values
        #: per output leaf (flatten order): its placements, fixed by the first forward (the
        #: handshake's dry run); None for a plain tensor
        self.out_placements: list[tuple[Any, ...] | None] | None = None
        #: (owner module, attribute name, local parameter, mesh, placements, shape, stride)
        self.entries: list[tuple[nn.Module, str, nn.Parameter, Any, tuple[Any, ...], Any, Any]] = []
        #: ids of local parameters whose placements shard them (not all Replicate)
        self.sharded: set[int] = set()
        self.mesh: Any = None

    def wrap(self, _module: nn.Module, _args: Any) -> None:
        """Forward pre-hook: each owner's attribute reads the DTensor view of its local shard."""
        from torch.distributed.tensor import DTensor

        for owner, name, local, mesh, placements, shape, stride in self.entries:
            dt = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=shape, stride=stride
            )
            owner.__dict__[name] = dt  # found before nn.Module.__getattr__'s _parameters

    def unwrap(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        """Forward hook: drop the DTensor views (the graph keeps what it saved) and make the
        output transportable."""
        for owner, name, *_ in self.entries:
            owner.__dict__.pop(name, None)
        return self.plain_output(output)

    def plain_output(self, output: Any) -> Any:
        """The output with each DTensor leaf replaced by its local part (module docstring);
        the placements must be those of the first forward, leaf by leaf."""
        from engine.runtime.stage import trees

        leaves = trees.with_paths(output, "output")
        seen = [tuple(t.placements) if _is_dtensor(t) else None for _, t in leaves]
        if self.out_placements is None:
            self.out_placements = seen
        elif seen != self.out_placements:
            pairs = zip(seen, self.out_placements, strict=False)
            k = next(i for i, (a, b) in enumerate(pairs) if a != b)
            raise PipelineInputError(
                f"stage {self.stage}'s {leaves[k][0]} has placements {seen[k]} but the pipeline "
                f"agreed {self.out_placements[k]} at its first step; a stage output keeps its "
                "placements (the next stage reads the local part with the agreed layout)"
            )
        for (path, t), pl in zip(leaves, seen, strict=True):
            if pl is not None:
                _check_placements(self.stage, path, pl, self.last)
        if isinstance(output, Tensor):
            return _plain(output)
        return trees.map_tensors(_plain, output)


def _is_dtensor(t: Any) -> bool:
    (DTensor,) = _dtensor_types()
    return isinstance(t, DTensor)


def _check_placements(stage: int, path: str, placements: tuple[Any, ...], last: bool) -> None:
    from torch.distributed.tensor import Partial, Replicate

    if any(isinstance(p, Partial) for p in placements):
        raise PipelineInputError(
            f"stage {stage}'s {path} is a DTensor with placements {placements}: a partial sum "
            "cannot travel as a local part. Reduce it first (RowwiseParallel's output_layouts="
            "Replicate() or Shard(d)) before the stage returns"
        )
    if last and not all(isinstance(p, Replicate) for p in placements):
        raise PipelineInputError(
            f"the last stage's {path} is a DTensor with placements {placements}; loss_fn "
            "needs the whole output on every tensor-parallel rank: redistribute it to "
            "Replicate() (RowwiseParallel's default output) before the stage returns"
        )


def _plain(t: Any) -> Any:
    """A stage output leaf as a plain tensor: a DTensor's local part (its gradient comes back
    with the same placements), an AsyncCollectiveTensor waited for."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if not isinstance(t, Tensor):
        return t
    if _is_dtensor(t):
        t = t.to_local()  # type: ignore[attr-defined]
    if isinstance(t, AsyncCollectiveTensor):
        t = t * 1  # waits; differentiable (the transport needs a plain tensor)
    return t


def localize(module: nn.Module, stage: int, last: bool = False) -> TensorParallelStage | None:
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
        for name, p in list(owner.named_parameters(recurse=False, remove_duplicate=False))
        if isinstance(p, DTensor)
    ]
    if not found:
        return None
    tp = TensorParallelStage(stage, last)
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
        setattr(owner, name, local)  # (registers the local shard under the same name)
        tp.entries.append((owner, name, local, mesh, placements, p.shape, p.stride()))
        if is_sharded(placements):
            tp.sharded.add(id(local))
    module.register_forward_pre_hook(tp.wrap)
    module.register_forward_hook(tp.unwrap, always_call=True)
    _TP_OF[module] = tp
    return tp


def is_sharded(placements: tuple[Any, ...]) -> bool:
    from torch.distributed.tensor import Replicate

    return not all(isinstance(p, Replicate) for p in placements)


def reduce_norms(
    params: list[Tensor], norms: list[Tensor], norm_type: float, group: Any
) -> list[Tensor]:
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
    return _SHARDED.get(id(p)) is p


def mark_sharded(tp: TensorParallelStage) -> None:
    """Tag the local parameters whose DTensor was sharded (read by :func:`reduce_norms`)."""
    for _o, _n, local, *_ in tp.entries:
        if id(local) in tp.sharded:
            _SHARDED[id(local)] = local
        else:
            _SHARDED.pop(id(local), None)


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


def localize_stages(
    modules: list[nn.Module], mine: list[int], layout: Any, num_stages: int
) -> list[TensorParallelStage | None]:
    """:func:`localize` every module this rank built; DTensor weights need a mesh with a
    ``tp`` dimension whose sub-mesh they live on."""
    tps = []
    for s, m in zip(mine, modules, strict=True):
        tp = localize(m, s, last=s == num_stages - 1)
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


def finish_stages(
    stages: list[Any], tps: list[TensorParallelStage | None], layout: Any, features: Any,
    executor: Any, rank: Any,
) -> None:
    """After the stages exist: refuse whole-matrix optimizers for sharded stages and give
    the clipper the tp group (its norms need the shards' sum)."""
    for st, tp in zip(stages, tps, strict=True):
        if tp is not None and st.bridge is not None:
            check_optimizer(st.index, st.bridge.opt, tp)
    if getattr(layout, "tp", 1) > 1 and features.autocast is torch.float16:
        raise PipelineConfigError(
            "autocast=torch.float16 with tensor parallelism: the loss scaler's overflow check "
            "reads each rank's gradient shards and is combined over the pipeline only, so the "
            "tp ranks of a stage could disagree on skipping an update (their replicated "
            "weights would drift apart). Use autocast=torch.bfloat16 (no loss scaling) with a mesh"
        )
    if getattr(layout, "tp", 1) > 1:  # activations: placements agreed at the handshake
        st = stages[0]
        connect_transport(rank.transport, tps[0], st.module, layout.tp_mesh, st.index)
    clipper = getattr(executor, "clipper", None)
    if clipper is not None and getattr(layout, "tp", 1) > 1:
        clipper.tp_group = layout.tp_group


# ---------------------------------------------------------------------- between stages


def _encode(placements: list[tuple[Any, ...] | None] | None) -> bytes:
    from torch.distributed.tensor import Replicate, Shard

    def one(p: Any) -> list[Any]:
        if isinstance(p, Shard):
            return ["shard", int(p.dim)]
        if isinstance(p, Replicate):
            return ["replicate"]
        return ["other", repr(p)]

    body = None if placements is None else [
        None if pl is None else [one(p) for p in pl] for pl in placements
    ]
    return json.dumps(body).encode()


def _decode(data: bytes) -> list[tuple[Any, ...] | None] | None:
    from torch.distributed.tensor import Replicate, Shard

    body = json.loads(data.decode())
    if body is None:
        return None
    return [
        None if pl is None else tuple(Shard(p[1]) if p[0] == "shard" else Replicate() for p in pl)
        for pl in body
    ]


def connect_transport(transport: Any, tp: TensorParallelStage | None, module: nn.Module,
                      mesh: Any, stage: int) -> None:
    """The placement agreement on one rank's transport (module docstring): its ``send_meta``
    of activations sends stage s's output placements after the Signature, its ``recv_meta``
    receives them, and the receiving stage's module gets a pre-hook that wraps the agreed
    leaves of its input into DTensors."""
    send_meta, recv_meta = transport.send_meta, transport.recv_meta
    receiver = _InputPlacements(stage, mesh)
    module.register_forward_pre_hook(receiver, with_kwargs=True)
    _INPUTS_OF[module] = receiver  # (what was agreed)

    def send(channel: str, tree: Any | None) -> None:
        send_meta(channel, tree)
        if channel != "act":
            return
        peer = transport.peer_stage(channel, "send")
        data = _encode(tp.out_placements if tp is not None and tree is not None else None)
        head = torch.tensor([len(data)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for t in (head, body):  # host messages: the transport's metadata path (control plane)
            transport.wait_host(transport.meta_send(t, peer), "sending the output placements", peer)

    def recv(channel: str) -> Any:
        sig = recv_meta(channel)
        if channel != "act":
            return sig
        peer = transport.peer_stage(channel, "recv")
        head = torch.zeros(1, dtype=torch.int64)
        what = "receiving the input placements"
        transport.wait_host(transport.meta_recv(head, peer), what, peer)
        body = torch.empty(int(head[0]), dtype=torch.uint8)
        transport.wait_host(transport.meta_recv(body, peer), what, peer)
        receiver.placements = _decode(body.numpy().tobytes())
        return sig

    transport.send_meta, transport.recv_meta = send, recv


class _InputPlacements:
    """Forward pre-hook of a receiving stage: input leaves agreed as DTensors become
    DTensors again (``from_local``, differentiable: the gradient of the local part travels
    back)."""

    def __init__(self, stage: int, mesh: Any) -> None:
        self.stage = stage
        self.mesh = mesh
        self.placements: list[tuple[Any, ...] | None] | None = None

    def __call__(self, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        if not self.placements or all(p is None for p in self.placements):
            return None
        from torch.distributed.tensor import DTensor

        from engine.runtime.stage import trees

        tree = kwargs if kwargs else args
        leaves, spec = trees.flatten(tree)
        if len(leaves) != len(self.placements):
            return None  # not the agreed input (stage 0's own batch never is: no agreement)
        out = [
            DTensor.from_local(x, self.mesh, pl, run_check=False)
            if pl is not None and isinstance(x, Tensor) and not _is_dtensor(x) else x
            for x, pl in zip(leaves, self.placements, strict=True)
        ]
        new = trees.unflatten(out, spec)
        return (args, new) if kwargs else (new, kwargs)
