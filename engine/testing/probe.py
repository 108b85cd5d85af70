"""Instrumentation: which weights each F and B of each micro-batch actually read.

``Probe`` is a layer with a weight vector (y = x * weight, elementwise) whose autograd
Function records, for the action the runtime is executing (stage, global micro-batch id,
kind), a copy of the weight it read: in forward the value it multiplied by, in backward the
value of the *saved* weight at B time (exactly what the backward computed with). Tests
compare these with the version history of ALGORITHMS.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from engine.runtime.stage import labels

__all__ = ["Probe"]


class _ProbeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, probe: Probe) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.probe = probe
        probe._record("F", weight)
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        ctx.probe._record("B", weight)
        gw = (grad * x).reshape(-1, weight.numel()).sum(0).reshape(weight.shape)
        return grad * weight, gw, None


class Probe(nn.Module):
    """y = x * weight with a record of every read: ``log`` holds dicts with keys stage, mb,
    kind ("F", "R" for a recomputed forward, "B", "W" for the weight-gradient half of a split
    backward) and value (a clone of the weight read)."""

    def __init__(self, dim: int, init: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), float(init)))
        self.log: list[dict[str, Any]] = []
        self._stage: int | None = None

    def _record(self, kind: str, weight: Tensor) -> None:
        cur = labels.CURRENT
        active = labels.ACTIVE.get(self._stage) if self._stage is not None else None
        if active is not None:  # one autograd call running several stages' backwards
            stage = self._stage
            mb, action = active
        elif cur is not None:
            stage, mb, action = cur
            if action == "F":
                self._stage = stage  # a probe belongs to the stage whose forward runs it
        else:
            return
        if kind == "F" and action in ("B", "W"):
            kind = "R"  # forward re-run inside a backward: recomputation
        elif kind == "B" and action == "W":
            kind = "W"  # the weight-gradient half of a split backward
        self.log.append({"stage": stage, "mb": mb, "kind": kind, "value": weight.detach().clone()})

    def forward(self, x: Tensor) -> Tensor:
        return _ProbeFn.apply(x, self.weight, self)
