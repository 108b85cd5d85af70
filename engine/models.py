"""Models the command line trains: a residual MLP made of L layers, split into S stages.

Why this model: the pipeline papers study *fine-grained* pipelines (one or a few layers per
stage), and the comparison must change the pipeline depth without changing the model, so
the model is a stack of L interchangeable blocks that any S <= L splits evenly. Blocks are
pre-norm residual (x + W2 relu(W1 LayerNorm(x)), W2 initialised small) because a deep plain
MLP trained at batch size 1 is itself hard to train, and that difficulty would be confused
with the staleness the comparison measures. LayerNorm normalises each sample on its own, so it
works at batch size 1 (Kosson et al. likewise replace batch norm); batch norm depends on the
batch, and the point is training without batches.

Layer 0 maps the features to the width, layer L-1 maps the width to the classes, and the
L-2 layers between are residual blocks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["ResidualBlock", "residual_mlp", "even_balance", "ModelError"]


class ModelError(ValueError):
    """A model/partition request that cannot be built; the message says the fix."""


class ResidualBlock(nn.Module):
    """x + fc2(relu(fc1(norm(x)))), fc2 scaled by 1/sqrt(depth) so the residual stream stays O(1)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        with torch.no_grad():
            self.fc2.weight.mul_(1.0 / math.sqrt(max(depth, 1)))
            self.fc2.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def residual_mlp(num_features: int, num_classes: int, layers: int, width: int) -> nn.Sequential:
    """An nn.Sequential of ``layers`` layers: stem, ``layers - 2`` residual blocks, head."""
    if layers < 2:
        raise ModelError(f"--layers {layers}: the model needs at least 2 layers (input and output)")
    if width < 1:
        raise ModelError(f"--width {width} must be >= 1")
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(num_features, width), nn.ReLU())]
    blocks += [ResidualBlock(width, layers - 2) for _ in range(layers - 2)]
    blocks.append(nn.Linear(width, num_classes))
    return nn.Sequential(*blocks)


def even_balance(layers: int, stages: int) -> list[int]:
    """Layer counts per stage, as even as possible (earlier stages get the remainder)."""
    if stages < 1:
        raise ModelError(f"--stages {stages} must be >= 1")
    if stages > layers:
        raise ModelError(
            f"--stages {stages} exceeds the model's {layers} layers (every stage needs at least one "
            f"layer); use --stages <= {layers} or --layers >= {stages}"
        )
    q, r = divmod(layers, stages)
    return [q + (1 if s < r else 0) for s in range(stages)]
