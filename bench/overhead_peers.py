"""Hand-written training loops that do the same math as engine.Pipeline's schedules.

These are the peers of bench/overhead.py: what a careful user would write in plain torch
for one process, with no pipeline runtime. A ratio engine/peer above 1 is the runtime's
overhead. Each peer is checked against the engine before timing (bench/overhead.py), so it
provably does the same work:

* ``GPipeLoop``: all forwards (keeping every graph), then all backwards, then one optimizer
  step per stage -- GPipe's math (and 1F1B's: both apply the mean gradient of M micro-batches
  once per mini-batch).
* ``MicroBatchLoop``: forward+backward per micro-batch, gradients accumulated, one step --
  the same math again, holding one graph at a time (the natural single-process 1F1B).
* ``PBTickLoop``: Kosson et al.'s pipelined backpropagation in dataflow order with live
  weights: at tick t stage s runs F(t-s), then B(t-2(S-1)+s) with its *current* weights, then
  a momentum-SGD step, so stage s sees a delay of 2(S-1-s) updates.
* ``PerSampleLoop``: zero_grad, forward, backward, step per micro-batch on the unsplit model
  (batch-1 training without a pipeline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LiveMomentumSGD", "GPipeLoop", "MicroBatchLoop", "PBTickLoop", "PerSampleLoop"]

LossFn = Callable[[Tensor, Any], Tensor]


class LiveMomentumSGD:
    """Momentum SGD (torch convention: first v = g, then v = m*v + g; w -= lr*v) written
    through ``p.data``.

    Why not torch.optim.SGD: under pipelined backprop a stage updates its weights while the
    autograd graphs of earlier forwards, which saved those very Parameters, are still waiting
    for their backward. An in-place op on the Parameter bumps its autograd version counter and
    that backward would raise; ``p.data`` shares the storage but not the counter, so the
    backward reads the *live* (updated) weights, which is exactly PB's semantics.
    """

    def __init__(self, params: Sequence[nn.Parameter], lr: float, momentum: float) -> None:
        self.weights = [p.data for p in params]
        self.lr = lr
        self.momentum = momentum
        self.bufs: list[Tensor] | None = None

    def step(self, grads: Sequence[Tensor]) -> None:
        if self.bufs is None:
            self.bufs = [g.clone() for g in grads]
        else:
            torch._foreach_mul_(self.bufs, self.momentum)
            torch._foreach_add_(self.bufs, list(grads))
        torch._foreach_add_(self.weights, self.bufs, alpha=-self.lr)


def _per_stage_optimizers(
    stages: Sequence[nn.Module], optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    return [optimizer(list(st.parameters())) for st in stages]


class GPipeLoop:
    """All M forwards, all M backwards, one step per stage (loss of micro-batch i scaled by
    1/M, as the engine's synchronous schedules do)."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        chunks: int,
        loss_fn: LossFn,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.stages = list(stages)
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.opts = _per_stage_optimizers(self.stages, optimizer)

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        scale = 1.0 / self.chunks
        losses = []
        for xm, ym in zip(x.chunk(self.chunks), y.chunk(self.chunks), strict=True):
            h = xm
            for st in self.stages:
                h = st(h)
            losses.append(self.loss_fn(h, ym) * scale)
        for loss in losses:
            loss.backward()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return torch.stack(losses).sum().detach()


class MicroBatchLoop:
    """Forward+backward per micro-batch with gradient accumulation, then one optimizer step
    per optimizer (pass one module for the unsplit model, or the stages)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        loss_fn: LossFn,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.modules = list(modules)
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.opts = _per_stage_optimizers(self.modules, optimizer)

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        scale = 1.0 / self.chunks
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(self.chunks), y.chunk(self.chunks), strict=True):
            h = xm
            for m in self.modules:
                h = m(h)
            loss = self.loss_fn(h, ym) * scale
            loss.backward()
            total += loss.detach()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total


class PerSampleLoop:
    """Plain training on the unsplit model, one optimizer step per micro-batch."""

    def __init__(
        self, model: nn.Module, chunks: int, loss_fn: LossFn, optimizer: torch.optim.Optimizer
    ) -> None:
        self.model = model
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.opt = optimizer

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        total = torch.zeros((), device=x.device)  # on the data's device: no host sync per sample
        for xm, ym in zip(x.chunk(self.chunks), y.chunk(self.chunks), strict=True):
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(xm), ym)
            loss.backward()
            self.opt.step()
            total += loss.detach()
        return total / self.chunks


class PBTickLoop:
    """Pipelined backpropagation (dataflow order, live weights, one update per micro-batch).

    Every stage keeps a tick counter. A call feeds ``chunks`` micro-batches and runs every
    stage as far as its inputs allow: stage s at tick t runs F(t-s) (graph kept), then
    B(t-2(S-1)+s) reading its live weights, then its momentum-SGD step. Stage s stops at the
    first tick whose forward has no input yet, exactly where the engine's pb stream stops, so
    the pipeline stays full across calls. Only the order *within* a stage matters for the
    math (stages share no weights), so running stages in index order inside a tick is exact.
    ``flush()`` runs the pending backwards (and updates) without new forwards.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        chunks: int,
        loss_fn: LossFn,
        lr: float,
        momentum: float,
    ) -> None:
        self.stages = list(stages)
        self.S = len(self.stages)
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.params = [list(st.parameters()) for st in self.stages]
        self.opts = [LiveMomentumSGD(p, lr, momentum) for p in self.params]
        self.tick = [0] * self.S
        self.fed = 0
        self.inputs: dict[int, Tensor] = {}  # micro-batch -> stage-0 input
        self.targets: dict[int, Any] = {}
        # (stage, micro-batch) -> (input that needs grad or None, output or loss)
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.acts: dict[tuple[int, int], Tensor] = {}  # output of stage s for micro-batch n
        self.grads: dict[tuple[int, int], Tensor] = {}  # grad w.r.t. the input of stage s
        self.losses: list[Tensor] = []

    def _forward(self, s: int, n: int) -> None:
        if s == 0:
            x, inp = self.inputs.pop(n), None
        else:
            inp = self.acts.pop((s - 1, n)).detach().requires_grad_()
            x = inp
        out = self.stages[s](x)
        if s == self.S - 1:
            out = self.loss_fn(out, self.targets.pop(n))
            self.losses.append(out.detach())
        else:
            self.acts[(s, n)] = out
        self.saved[(s, n)] = (inp, out)

    def _backward(self, s: int, n: int) -> None:
        inp, out = self.saved.pop((s, n))
        grad_out = None if s == self.S - 1 else self.grads.pop((s + 1, n))
        wrt = self.params[s] if inp is None else [inp, *self.params[s]]
        grads = torch.autograd.grad(out, wrt, grad_out)
        if inp is not None:
            self.grads[(s, n)] = grads[0]
            grads = grads[1:]
        self.opts[s].step(grads)

    def _run(self) -> None:
        S = self.S
        # stage s runs ticks up to fed+s-1 (its last forward with an input)
        for t in range(min(self.tick), self.fed + S - 1):
            for s in range(S):
                if self.tick[s] != t or t - s >= self.fed:
                    continue
                if t - s >= 0:
                    self._forward(s, t - s)
                n = t - 2 * (S - 1) + s
                if n >= 0 and (s, n) in self.saved:
                    self._backward(s, n)
                self.tick[s] = t + 1

    def __call__(self, x: Tensor, y: Tensor) -> Tensor:
        for xm, ym in zip(x.chunk(self.chunks), y.chunk(self.chunks), strict=True):
            self.inputs[self.fed] = xm
            self.targets[self.fed] = ym
            self.fed += 1
        self.losses = []
        self._run()
        return torch.stack(self.losses).mean() if self.losses else torch.tensor(float("nan"))

    def flush(self) -> None:
        """Finish every micro-batch in flight (backwards and updates in order per stage)."""
        pending = sorted({n for (_, n) in self.saved})
        for n in pending:
            for s in range(self.S - 1, -1, -1):
                if (s, n) in self.saved:
                    self._backward(s, n)
        # the next call starts a fresh fill, as after the engine's flush
        self.tick = [self.fed + s for s in range(self.S)]
