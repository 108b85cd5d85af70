"""A rank's ``Pipeline.step`` call: what this rank reads of the user's batch, the shape
handshake at its first step, and the translation of its failure for its peers.

Why a module of its own: every rank receives the same ``step(inputs, targets)`` call, but
only the rank holding stage 0 reads the inputs and only the one holding the last stage reads
the targets (under a V placement one rank holds both); the rest get the shapes through the
handshake. Running the rank's step program is :class:`~engine.runtime.ranks.rank.RankExecutor`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.errors import PeerError, PipelineInputError
from engine.runtime.stage import inputs as _inputs
from engine.runtime.stage import trees
from engine.runtime.ranks.first_failure import as_peer_error, begin, report

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts

__all__ = ["rank_step"]


def rank_step(parts: PipelineParts, inputs: Any, targets: Any) -> Tensor:
    """``Pipeline.step`` on one rank: split what this rank reads, handshake once, run."""
    begin()  # first thing: every rank counts every step call, even one that fails early
    if parts.rank.broken:
        raise PeerError(parts.rank.broken)
    lay = parts.layout
    M = parts.spec.chunks
    held = parts.executor.by_index  # (under a V placement one rank holds the first and the last)
    first, last = 0 in held, parts.spec.stages - 1 in held
    if parts.device.type == "cuda":  # NCCL: the data a rank reads goes to its GPU
        inputs = trees.map_tensors(lambda t: t.to(parts.device, non_blocking=True), inputs)
        targets = trees.map_tensors(lambda t: t.to(parts.device, non_blocking=True), targets)
    if first and not trees.tensors(inputs):
        raise PipelineInputError(
            f"rank {lay.rank} runs stage 0 and needs the inputs: pass a tensor (or a tuple/list/"
            f"dict of tensors) with the batch on dim 0, got {type(inputs).__name__}"
        )
    if first:
        xs, ts, sizes = _inputs.split(inputs, targets if last else None, M)
        if not last:
            ts = [None] * M
    elif last:
        if trees.tensors(targets):
            _, ts, sizes = _inputs.split(None, targets, M, read_inputs=False)
        elif trees.tensors(inputs):  # the batch size from the inputs
            _, ts, sizes = _inputs.split(inputs, targets, M)
        else:
            raise PipelineInputError(
                f"rank {lay.rank} runs the last stage and needs the targets (a tensor, or a "
                "tree of tensors, with the batch on dim 0) to compute the loss"
            )
        xs = [None] * M
    else:
        xs, ts, sizes = [None] * M, [None] * M, [1] * M
    rk = parts.rank
    ex = parts.executor
    base = ex.j * M if ex.active else 0  # the step's first micro-batch in the segment
    notices = getattr(rk, "notices", None)  # NCCL (transport/shape_notice.py)
    try:
        with parts.autocast():  # the dry runs see the dtypes autocast gives
            if not rk.handshaken:
                st = parts.stages[0]
                rk.handshake(st.module, xs[0], ts[0], st.loss_fn)
                if first and notices is not None:
                    notices.seen(xs[0])
            elif first:  # new shapes: a clear error before the step instead of one inside it
                try:
                    rk.check_inputs(parts.stages[0].module, xs, base)
                except PipelineInputError as exc:
                    if notices is not None:  # every rank raises it, before the step
                        notices.announce([], base, error=str(exc))
                    raise
        if notices is not None:
            if first:
                notices.announce(xs, base)
            else:
                notices.receive(base)
        result = ex.run_step(xs, ts, sizes)
    except BaseException as exc:  # the first rank to fail is named in its peers' errors
        report(lay.rank, exc)
        mine = sorted(held)
        where = f"stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}"
        peer = as_peer_error(exc, lay.rank, f"{where} (rank {lay.rank})")
        if peer is exc:
            raise
        raise peer from exc
    return result.loss if result.loss is not None else torch.tensor(float("nan"))
