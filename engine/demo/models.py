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

The language model (``--task lm``, :func:`gpt`) is a GPT-style decoder made the same way, so
the same S <= L split applies: layer 0 embeds tokens and positions, layers 1..L-2 are pre-norm
transformer blocks (causal self-attention, then an MLP), layer L-1 is the final LayerNorm and
the LM head. The causal mask is made once, by layer 0, and travels between stages as a tensor
next to the activations (every block returns ``(h, mask)``, which the runtime passes to the
next stage as ``module(h, mask)``), so a stage never rebuilds it and a padding or document
mask could replace it without touching the blocks. The head reuses the token embedding's
``nn.Parameter`` (tied weights: on synchronous schedules the engine keeps one copy per
holding stage equal, engine/runtime/ties/groups.py; on asynchronous ones the head reads the value
the embedding's stage read, engine/runtime/ties/carry.py). ``tie=False`` gives the head its
own parameter, initialised to the same values (an untied model, for comparisons).
The head returns logits as (batch, vocab, time), the layout ``cross_entropy`` takes with
(batch, time) targets, so the classification loss and accuracy code serves both tasks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ResidualBlock",
    "residual_mlp",
    "even_balance",
    "ModelError",
    "LayerChain",
    "TokenEmbedding",
    "TransformerBlock",
    "LMHead",
    "gpt",
    "split_layers",
]


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


# ------------------------------------------------------------------ the language model


class LayerChain(nn.Sequential):
    """An ``nn.Sequential`` whose layers pass tuples on as positional arguments.

    ``nn.Sequential`` calls every layer with one argument; the transformer's layers take and
    return ``(h, mask)``. This applies the runtime's rule for stage outputs (a tuple is
    called as ``layer(*out)``) inside a stage too, so the whole model and any cut of it run
    the same way.
    """

    def forward(self, *args: Any) -> Any:
        out: Any = args if len(args) != 1 else args[0]
        for layer in self:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


class TokenEmbedding(nn.Module):
    """Layer 0: token + position embeddings and the causal mask, returned as ``(h, mask)``.

    ``mask[i, j]`` is True where position i must not attend to position j (j > i).
    """

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        with torch.no_grad():  # GPT-2's scale: unit-variance embeddings swamp the residual stream
            self.tok.weight.normal_(0.0, 0.02)
            self.pos.weight.normal_(0.0, 0.02)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        T = tokens.shape[-1]
        if T > self.pos.num_embeddings:
            raise ModelError(
                f"sequence of {T} tokens exceeds the model's context {self.pos.num_embeddings}"
            )
        h = self.tok(tokens) + self.pos.weight[:T]
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
        return h, mask


class TransformerBlock(nn.Module):
    """Pre-norm block: h + attn(LN(h), mask), then h + mlp(LN(h)); returns ``(h, mask)``."""

    def __init__(self, width: int, heads: int, depth: int) -> None:
        super().__init__()
        if width % heads:
            raise ModelError(f"--width {width} must be a multiple of the {heads} attention heads")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        with torch.no_grad():  # residual branches start small, as in ResidualBlock
            for out in (self.proj, self.fc2):
                out.weight.mul_(1.0 / math.sqrt(2 * max(depth, 1)))
                out.bias.zero_()

    def forward(self, h: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        B, T, C = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, C/heads)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        h = h + self.fc2(torch.relu(self.fc1(self.ln2(h))))
        return h, mask


class LMHead(nn.Module):
    """Layer L-1: LayerNorm, then logits against ``weight`` (the token embedding's when tied),
    as (batch, vocab, time)."""

    def __init__(self, width: int, weight: nn.Parameter) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight = weight

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        return (self.norm(h) @ self.weight.t()).transpose(1, 2)


def gpt(
    vocab: int, context: int, layers: int, width: int, heads: int = 2, *, tie: bool = True
) -> LayerChain:
    """A GPT-style decoder of ``layers`` layers: embedding, ``layers - 2`` blocks, tied head.

    With ``tie=False`` the head owns a copy of the embedding's initial weight (the same
    function at step 0; it then trains on its own).
    """
    if layers < 2:
        raise ModelError(f"--layers {layers}: the model needs at least 2 layers (embedding and head)")
    if heads < 1:
        raise ModelError(f"heads={heads} must be >= 1")
    embed = TokenEmbedding(vocab, context, width)
    blocks = [TransformerBlock(width, heads, layers - 2) for _ in range(layers - 2)]
    w = embed.tok.weight if tie else nn.Parameter(embed.tok.weight.detach().clone())
    return LayerChain(embed, *blocks, LMHead(width, w))


def split_layers(model: nn.Sequential, balance: list[int]) -> list[nn.Sequential]:
    """Consecutive stages of ``model`` keeping its layer names (``split_sequential``), each
    of the model's own class, so a cut of a :class:`LayerChain` passes tuples on as it does."""
    from engine.partition import split_sequential

    from engine.model_names import declare

    stages = split_sequential(model, balance)
    return [declare(type(model)(OrderedDict(s.named_children())), "") for s in stages]
