"""Throughput of a pipeline as the user sees it: step time, samples/s, tokens/s, and the
measured bubble next to the modelled one (``stats()["throughput"]``).

Why a module: the numbers people watch while training come from three places -- the wall time
of each ``step()`` call, the batch it was given, and the time the stages held by this process
spent computing -- and are put together here.

* ``step_time_s``: mean wall time of a ``step()`` since the last ``reset_stats()``
  (``last_step_time_s``: the latest one). Asynchronous steps include the backwards and
  updates of earlier micro-batches that ran in them.
* ``samples_per_s``: samples fed per second of step time (the batch's dim 0, read from the
  inputs, else the targets; None on a rank that passes neither). ``tokens_per_s``: the same
  for token ids -- the first integer tensor with at least two dims (batch x sequence) among
  the inputs (else the targets) counts its elements; None when there is none.
* ``bubble_modelled``: the schedule's idle share with unit costs (``bubble_fraction``);
  ``bubble_measured``: locally the replay of the schedule with each action's measured time
  (``bubble_fraction_wall``: stages in one process run one at a time, so wall-clock idleness
  of a stage does not exist there); under gloo/NCCL the share of this rank's step time not
  spent in its stages' forwards, backwards and updates (waits on other ranks included).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.runtime.stage import trees

__all__ = ["StepMeter", "batch_size"]


def batch_size(inputs: Any, targets: Any) -> tuple[int | None, int | None]:
    """(samples, tokens) of one ``step()``'s batch (module docstring)."""
    samples = tokens = None
    for tree in (inputs, targets):
        leaves = [t for t in trees.tensors(tree) if t.dim() > 0] if tree is not None else []
        if samples is None and leaves:
            samples = int(leaves[0].shape[0])
        if tokens is None:
            ids = [t for t in leaves if t.dim() >= 2 and not t.is_floating_point()
                   and not t.is_complex() and t.dtype != torch.bool]
            if ids:
                tokens = int(ids[0].numel())
    return samples, tokens


class StepMeter:
    """Wall time and batch sizes of the ``step()`` calls since the last reset."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.last = 0.0
        self.samples: int | None = 0
        self.tokens: int | None = 0

    def record(self, seconds: float, samples: int | None, tokens: int | None) -> None:
        self.steps += 1
        self.seconds += seconds
        self.last = seconds
        self.samples = None if samples is None or self.samples is None else self.samples + samples
        self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens

    def stats(self, busy_seconds: float, bubble_unit: float, bubble_wall: float,
              distributed: bool) -> dict[str, Any]:
        sec = self.seconds
        per = (lambda n: n / sec if n is not None and sec > 0 and self.steps else None)
        measured = bubble_wall
        if distributed:
            measured = max(0.0, 1.0 - busy_seconds / sec) if sec > 0 else 0.0
        return {
            "steps": self.steps,
            "step_time_s": sec / self.steps if self.steps else None,
            "last_step_time_s": self.last if self.steps else None,
            "samples_per_s": per(self.samples),
            "tokens_per_s": per(self.tokens),
            "bubble_modelled": bubble_unit,
            "bubble_measured": measured,
        }
