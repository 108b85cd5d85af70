"""Forward-only evaluation through a pipeline: ``Pipeline.evaluate``.

Why apart from the step machinery: evaluation must not disturb training. It runs every
stage's module in eval mode without autograd on the stages' *live* weights (the newest
version; for an asynchronous pipeline, not the versions micro-batches in flight read, and no
prediction), one micro-batch at a time, and touches nothing a step keeps: no stash, weight
version, gradient, update count, RNG state or in-flight activation. Under gloo/NCCL it talks
over a process group of its own (created on the first call, collectively), so its messages
can never meet a training step's pending sends. With ``autocast=``, every stage's module runs
under the pipeline's autocast state, as a step's forward does (engine/runtime/precision.py).
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineInputError
from engine.runtime.stage import trees
from engine.runtime.precision import autocast_context
from engine.runtime.exec.placement import RankPlacement

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts

__all__ = ["evaluate"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_HEADER = 10  # ndim, dtype code, up to 8 dims
_TREE = -1  # a header of -1s: a tree of tensors follows (_send)


@contextlib.contextmanager
def _eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    modes = [[m.training for m in module.modules()] for module in modules]
    try:
        for module in modules:
            module.eval()
        with torch.no_grad():
            yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            for m, training in zip(module.modules(), mode, strict=True):
                m.training = training


def _forward(module: nn.Module, x: Any, autocast: tuple[torch.dtype, str] | None) -> Any:
    """One stage's module on ``x``, under the stage's autocast state when it has one."""
    with autocast_context(*autocast) if autocast is not None else contextlib.nullcontext():
        return module(x) if isinstance(x, Tensor) else trees.call(module, x)


def _chunks(inputs: Any, chunks: int) -> list[Tensor]:
    if not isinstance(inputs, Tensor) or inputs.dim() == 0:
        raise PipelineInputError(
            f"evaluate() needs a tensor with the batch on dim 0, got {type(inputs).__name__}"
        )
    if inputs.shape[0] == 0:
        raise PipelineInputError("evaluate() got an empty batch (0 samples)")
    return list(inputs.chunk(min(chunks, int(inputs.shape[0]))))


def evaluate(parts: PipelineParts, inputs: Any, chunks: int | None = None) -> Any:
    """The last stage's module outputs for ``inputs`` (module docstring), concatenated on
    dim 0 (a list with one output per micro-batch when the last stage returns a tree);
    ``chunks`` micro-batches (default: the pipeline's). ``inputs`` may be a tree locally."""
    M = parts.spec.chunks if chunks is None else chunks
    if not isinstance(M, int) or M < 1:
        raise PipelineInputError(f"chunks={chunks!r} is invalid: evaluate in >= 1 micro-batches")
    if parts.config.distributed:
        return _evaluate_rank(parts, inputs, M)
    modules = [st.module for st in parts.stages]
    casts = [st.autocast for st in parts.stages]
    if isinstance(inputs, Tensor):
        pieces: list[Any] = _chunks(inputs, M)
    else:  # a tree (engine.runtime.stage.trees): every tensor leaf split on dim 0
        from engine.runtime.stage.inputs import split

        pieces = split(inputs, None, M)[0]
    from engine.runtime.stage.inputs import stage_input_error

    outs = []
    with _eval_mode(modules):
        for x in pieces:
            for s, module in enumerate(modules):
                try:
                    x = _forward(module, x, casts[s])
                except Exception as exc:  # no weight changes in evaluation: name the stage
                    raise stage_input_error(s, module, x, exc) from exc
            outs.append(x)
    if all(isinstance(o, Tensor) for o in outs):
        return torch.cat(outs)
    return outs  # tree outputs: one per micro-batch


# ----------------------------------------------------------------------------- gloo / NCCL


def _group(parts: PipelineParts) -> Any:
    """The evaluation process group of this rank's replica (created once, collectively:
    every rank creates every replica's group in the same order)."""
    group = parts.eval_group
    if group is None:
        lay = parts.layout
        S = lay.stages
        lines = [[r * S + s for s in range(S)] for r in range(lay.replicas)]
        if hasattr(lay, "pp_lines"):  # a mesh: one line per (replica, tp rank), runtime/ranks/mesh.py
            lines = lay.pp_lines()
        for ranks in lines:
            g = torch.distributed.new_group(
                ranks, timeout=datetime.timedelta(seconds=parts.config.timeout)
            )
            if lay.rank in ranks:
                group = g
        parts.eval_group = group
    return group


def _p2p(op: Any, t: Tensor, peer: int, group: Any) -> None:
    """One message as a batch of its own on ``group``'s communicator (an unbatched
    send/recv would make NCCL create a two-rank communicator per pair), waited for: under
    NCCL the caller's stream waits, under gloo the host."""
    for work in torch.distributed.batch_isend_irecv([torch.distributed.P2POp(op, t, peer, group)]):
        work.wait()


def _send(t: Any, dst: int, group: Any, device: torch.device) -> None:
    """A tensor (a header, then the data), or a tree of them (a header saying so, the tree's
    structure and constants as one pickled message, then each tensor leaf): what stages pass,
    e.g. the value of a tied weight an asynchronous schedule carries (tie_carry.py)."""
    isend = torch.distributed.isend
    if not isinstance(t, Tensor):
        leaves, spec = trees.flatten(t)
        meta = [spec, [None if isinstance(x, Tensor) else x for x in leaves],
                [isinstance(x, Tensor) for x in leaves]]
        body = pickle.dumps(meta)
        header = torch.full((_HEADER,), _TREE, dtype=torch.int64)
        header[1] = len(body)
        _p2p(isend, header.to(device), dst, group)
        _p2p(isend, torch.frombuffer(bytearray(body), dtype=torch.uint8).to(device), dst, group)
        for x in leaves:
            if isinstance(x, Tensor):
                _send(x, dst, group, device)
        return
    if t.dim() > _HEADER - 2 or t.dtype not in _DTYPES:
        raise PipelineInputError(
            f"evaluate() under gloo/NCCL sends tensors of at most {_HEADER - 2} dims and a "
            f"standard dtype, got {t.dtype} with shape {tuple(t.shape)}"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    _p2p(isend, header.to(device), dst, group)
    _p2p(isend, t.contiguous().to(device), dst, group)


def _recv(src: int, group: Any, device: torch.device) -> Any:
    irecv = torch.distributed.irecv
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    _p2p(irecv, header, src, group)
    header = header.cpu()  # (a host read: evaluation is not the hot path)
    if int(header[0]) == _TREE:
        body = torch.empty(int(header[1]), dtype=torch.uint8, device=device)
        _p2p(irecv, body, src, group)
        spec, consts, is_tensor = pickle.loads(body.cpu().numpy().tobytes())
        leaves = [_recv(src, group, device) if t else c for c, t in zip(consts, is_tensor, strict=True)]
        return trees.unflatten(leaves, spec)
    n = int(header[0])
    shape = [int(v) for v in header[2 : 2 + n]]
    buf = torch.empty(shape, dtype=_DTYPES[int(header[1])], device=device)
    _p2p(irecv, buf, src, group)
    return buf


def _evaluate_rank(parts: PipelineParts, inputs: Any, M: int) -> Tensor:
    """Every rank calls it with the same arguments (stage 0 reads ``inputs``); every rank
    returns the last stage's outputs. With virtual stages a rank runs each of its stages in
    turn, receiving from the previous stage's rank and sending to the next one's (or, where
    it holds both, as under the V placement, passing the output on in the process); a
    micro-batch passes the stages one at a time, so the blocking messages between two ranks
    arrive in the order they are sent."""
    lay = parts.layout
    place = RankPlacement.of(parts.spec)  # round-robin, the V, or any map
    first, last = lay.stage == place.first, lay.stage == place.last
    if not isinstance(inputs, Tensor) and first:
        raise PipelineInputError(
            "evaluate() under gloo/NCCL takes a tensor of inputs (stages may pass trees); "
            "for tree-valued inputs evaluate on a local pipeline"
        )
    S = parts.spec.stages
    ranks = lay.pipeline_ranks
    group = _group(parts)
    device = parts.device
    held = [(st.index, st.module) for st in parts.stages]
    casts = {st.index: st.autocast for st in parts.stages}
    outs = []
    with _eval_mode([m for _, m in held]):
        n = len(_chunks(inputs, M)) if first else 0
        count = torch.tensor([n], dtype=torch.int64, device=device)
        torch.distributed.broadcast(count, ranks[place.first], group=group)
        pieces = _chunks(inputs, M) if first else [None] * int(count)
        for x in pieces:
            for s, module in held:
                if s == 0:
                    x = x.to(device)
                elif not place.same_rank(s - 1):
                    x = _recv(ranks[place.rank_of(s - 1)], group, device)
                x = _forward(module, x, casts[s])
                if s == S - 1:
                    outs.append(x)
                elif not place.same_rank(s):
                    _send(x, ranks[place.rank_of(s + 1)], group, device)
    # every rank returns the outputs: the last stage sends them to the others
    if last:
        result = torch.cat(outs)
        for r in ranks:
            if r != ranks[place.last]:
                _send(result, r, group, device)
        return result
    return _recv(ranks[place.last], group, device)
