"""BatchNorm whose running statistics cover the whole mini-batch, not each micro-batch.

Why: a pipeline feeds a stage M micro-batches per mini-batch, so a plain BatchNorm updates its
running mean and variance M times, each from 1/M of the samples: the statistics an evaluation
run then uses differ from those of the same model trained unpipelined on the mini-batch.
torchgpipe's answer, kept here: each micro-batch is *normalised* with its own batch
statistics (the training math is unchanged), while the running statistics only *accumulate*
sums; after the M-th micro-batch they are updated once, from the whole mini-batch's mean and
unbiased variance, and ``num_batches_tracked`` advances by one -- as an unpipelined model's
would with that batch.

The accumulators are buffers, so a stage's recomputation (which puts every running statistic
back after it has run, see ``Stage._recomputable``) never counts a micro-batch twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm (any dimensionality) that updates its running statistics once per
    ``chunks`` training forwards, from all of them together (module docstring)."""

    def __init__(self, num_features: int, chunks: int, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        if chunks < 1:
            raise ValueError(f"chunks={chunks!r} is invalid: a mini-batch has at least 1 micro-batch")
        self.chunks = chunks
        self.register_buffer("sum", torch.zeros(num_features), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features), persistent=False)
        self.register_buffer("samples", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("tracked", torch.zeros((), dtype=torch.long), persistent=False)

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects (N, C, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)
        with torch.no_grad():
            dims = [d for d in range(x.dim()) if d != 1]
            xf = x.detach().to(self.sum.dtype)
            self.sum += xf.sum(dims)
            self.sum_squares += (xf * xf).sum(dims)
            self.samples += x.numel() // x.size(1)
            self.tracked += 1
            if int(self.tracked) == self.chunks:
                self._commit()
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _commit(self) -> None:
        n = int(self.samples)
        mean = self.sum / n
        var = (self.sum_squares / n - mean * mean).clamp_(min=0.0)
        if n > 1:
            var *= n / (n - 1)  # running_var keeps the unbiased estimate, as nn.BatchNorm
        self.num_batches_tracked += 1
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(var, alpha=m)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.samples.zero_()
        self.tracked.zero_()

    @classmethod
    def from_batch_norm(cls, bn: nn.modules.batchnorm._BatchNorm, chunks: int) -> DeferredBatchNorm:
        """A DeferredBatchNorm with ``bn``'s options, parameters and statistics."""
        if not bn.track_running_stats:
            raise ValueError("a BatchNorm without running statistics has nothing to defer")
        out = cls(bn.num_features, chunks, bn.eps, bn.momentum, bn.affine)
        device, dtype = bn.running_mean.device, bn.running_mean.dtype
        out.to(device=device, dtype=dtype)
        with torch.no_grad():
            if bn.affine:
                out.weight = bn.weight  # the same Parameter: optimizers and ties keep working
                out.bias = bn.bias
            out.running_mean.copy_(bn.running_mean)
            out.running_var.copy_(bn.running_var)
            out.num_batches_tracked.copy_(bn.num_batches_tracked)
        out.train(bn.training)
        return out


def convert_deferred_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """Replace every BatchNorm with running statistics in ``module`` (in place, and the
    module itself if it is one) by a :class:`DeferredBatchNorm` over ``chunks`` micro-batches."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, DeferredBatchNorm):
        return DeferredBatchNorm.from_batch_norm(module, chunks) if module.track_running_stats else module
    for name, child in module.named_children():
        new = convert_deferred_batch_norm(child, chunks)
        if new is not child:
            setattr(module, name, new)
    return module
