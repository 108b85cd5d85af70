"""PipeMare T1 learning-rate rescheduling as a torch LRScheduler.

    lr_{k,s} = lr_k * tau_s ** -(1 - min(k / K, 1))        tau_s = max(delay_s, 1)

Design (why a multiplier, not group["lr"]): the base schedule lr_k belongs to whatever other
scheduler the user runs (StepLR, OneCycleLR, ...), and those write ``group["lr"]``, some
relative to its current value (StepLR multiplies it), some absolutely (OneCycleLR). If
PipeMareLR also wrote ``group["lr"]`` the two would compound or overwrite each other depending
on call order. Instead PipeMareLR owns only ``group["lr_scale"]`` = tau_s ** -(1 - min(k/K, 1))
and the engine optimizers apply ``group["lr"] * group["lr_scale"]`` at step time. The product
is exactly the formula whatever the other schedulers do and in whichever order their step()s
are called; ``lr_scale`` is an ordinary group key, so it is saved and restored by the
optimizer's state_dict.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.optim.base import DelayOptimizer

__all__ = ["PipeMareLR"]


class PipeMareLR(LRScheduler):
    """PipeMare's T1 (Yang et al., MLSys 2021): shrink each stage's lr by its delay early on.

    At scheduler step k (0 at construction, +1 per ``step()``), every param group s gets the
    multiplier ``tau_s ** -(1 - min(k / K, 1))`` with ``tau_s = max(group["delay"], 1)`` read
    at each step (the pipeline may set delays after the scheduler exists) and K =
    ``warmup_steps``; ``K = 0`` means no warm-up (multiplier 1 from the start). Groups with
    delay 0 or 1 are never rescaled.

    ``get_last_lr()`` returns the effective rates ``group["lr"] * group["lr_scale"]``, i.e.
    what the next optimizer step uses.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, DelayOptimizer):
            raise TypeError(
                f"PipeMareLR needs an engine.optim optimizer (SGD, Adam, AdamW), got "
                f"{type(optimizer).__name__}: it sets group['lr_scale'], which only engine "
                "optimizers apply at step time"
            )
        if not isinstance(warmup_steps, numbers.Integral) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: it must be an int >= 0 (K of PipeMare T1)")
        self.warmup_steps = int(warmup_steps)
        super().__init__(optimizer, last_epoch)

    def scales(self, k: int | None = None) -> list[float]:
        """The multipliers tau_s ** -(1 - min(k / K, 1)) per group at step ``k`` (default: now)."""
        k = self.last_epoch if k is None else k
        progress = 1.0 if self.warmup_steps == 0 else min(k / self.warmup_steps, 1.0)
        return [float(max(g["delay"], 1)) ** -(1.0 - progress) for g in self.optimizer.param_groups]

    def get_lr(self) -> list[Any]:
        """Effective learning rates after applying this step's multipliers."""
        return [DelayOptimizer.effective_lr(g) for g in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance k (or set it to ``epoch``) and write each group's ``lr_scale``.

        Overrides LRScheduler.step because the base class writes ``group["lr"]``, which this
        scheduler deliberately leaves to the base schedule (module docstring).
        """
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if epoch is None else int(epoch)
        for group, scale in zip(self.optimizer.param_groups, self.scales(), strict=True):
            group["lr_scale"] = scale
        self._last_lr = self.get_lr()
