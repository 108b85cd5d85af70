"""SGD with a sparse gradient (``nn.Embedding(sparse=True)``): torch's plain update.

Why apart from ``engine.optim.functional``: it is torch.optim.SGD's sparse single-tensor path
op for op, with none of the delay mitigations or fused kernels (the optimizers refuse those
combinations before calling it), so it shares nothing with the dense reference but its name.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["sgd_sparse_update"]


def sgd_sparse_update(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """SGD with a sparse gradient (``nn.Embedding(sparse=True)``), torch.optim.SGD's
    single-tensor path op for op: the momentum buffer is the first gradient's clone (sparse
    too), so the state stays in torch's form. No mitigations, no AMP arguments: the
    optimizers refuse those combinations before calling this."""
    g = grad if not maximize else -grad
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = g.detach().clone()
            state["momentum_buffer"] = buf
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    param.add_(g, alpha=-lr)
