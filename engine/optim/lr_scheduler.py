"""PipeMare T1 learning-rate rescheduling as a torch LRScheduler.

    lr_{k,s} = lr_k * tau_s ** -(1 - min(k / K, 1))        tau_s = max(delay_s, 1)

``group["lr"]`` is the rate the next update applies, as with torch's schedulers: a user
logging ``param_groups[0]["lr"]`` or ``get_last_lr()`` sees what is applied (a
``group["lr_scale"]`` that older checkpoints carry is still applied inside the step,
engine/optim/base.py).

How it composes with the base schedule lr_k, which belongs to other schedulers:

* torch's chainable schedulers (StepLR, ExponentialLR, MultiStepLR, LinearLR, ...) multiply
  ``group["lr"]`` by their factor; PipeMareLR is chainable too (it replaces its previous
  multiplier by the new one), so they compose in either order, as torch's chain.
* schedulers that write lr_k from their own state (OneCycleLR, LambdaLR, CyclicLR) overwrite
  the multiplier: pass ``absolute_base=True`` and step PipeMareLR after them; it then reads
  ``group["lr"]`` as lr_k whenever it was rewritten since its own last step.

Group keys (saved with the optimizer's state_dict): ``pipemare_scale`` (the multiplier in
``group["lr"]`` now), ``pipemare_base`` (lr_k) and ``pipemare_lr`` (the rate PipeMareLR last
wrote: a different value means another scheduler wrote since). An old checkpoint's
``lr_scale`` (the multiplier applied inside the step) is folded into these at the next step.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import Tensor
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
    delay 0 or 1 are never rescaled. ``group["lr"]`` and ``get_last_lr()`` are the rates the
    next optimizer step applies; ``absolute_base=True`` when another scheduler writes the base
    rate from its own state at every step (module docstring).
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int, last_epoch: int = -1, *,
                 absolute_base: bool = False) -> None:
        if not isinstance(optimizer, DelayOptimizer):
            raise TypeError(
                f"PipeMareLR needs an engine.optim optimizer (SGD, Adam, AdamW, NAdam), got "
                f"{type(optimizer).__name__}: it reads each group's 'delay' (tau_s), which only "
                "engine optimizers keep"
            )
        if not isinstance(warmup_steps, numbers.Integral) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: it must be an int >= 0 (K of PipeMare T1)")
        self.warmup_steps = int(warmup_steps)
        self.absolute_base = bool(absolute_base)
        super().__init__(optimizer, last_epoch)

    def scales(self, k: int | None = None) -> list[float]:
        """The multipliers tau_s ** -(1 - min(k / K, 1)) per group at step ``k`` (default: now)."""
        k = self.last_epoch if k is None else k
        progress = 1.0 if self.warmup_steps == 0 else min(k / self.warmup_steps, 1.0)
        return [float(max(g["delay"], 1)) ** -(1.0 - progress) for g in self.optimizer.param_groups]

    def get_lr(self) -> list[Any]:
        """The rates the next step applies (``group["lr"]``, this scheduler's multiplier in)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance k (or set it to ``epoch``) and put this step's multiplier into each group's
        ``lr`` in place of the previous one."""
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if epoch is None else int(epoch)
        for group, scale in zip(self.optimizer.param_groups, self.scales(), strict=True):
            _rescale(group, scale, self.absolute_base)
        self._last_lr = self.get_lr()


def _rescale(group: dict[str, Any], scale: float, absolute_base: bool) -> None:
    lr = group["lr"]
    now = float(lr.detach()) if isinstance(lr, Tensor) else float(lr)
    if "lr_scale" in group:  # an old checkpoint: lr was the base, the step applied lr_scale
        group.pop("lr_scale")
        base = now
    elif "pipemare_lr" not in group:  # first step: lr is the base schedule's
        base = now
    elif now == group["pipemare_lr"]:  # nobody wrote since: the exact base we kept
        base = group["pipemare_base"]
    elif absolute_base:  # rewritten from the other scheduler's state: lr_k itself
        base = now
    else:  # a chainable scheduler multiplied the rate we left: divide our multiplier out
        base = now / group["pipemare_scale"]
    new = base * scale
    if isinstance(lr, Tensor):
        lr.fill_(new)
    else:
        group["lr"] = new
    group["pipemare_base"] = base
    group["pipemare_scale"] = scale
    group["pipemare_lr"] = float(group["lr"].detach()) if isinstance(lr, Tensor) else new
