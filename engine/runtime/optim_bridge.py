"""What the runtime asks of a stage optimizer, for engine.optim and plain torch.optim alike.

Why a bridge: the mitigations are options of the stage optimizers (engine.optim's
``delay``, ``prediction``, ``discrepancy_correction``), but users may also hand the pipeline a
plain ``torch.optim`` optimizer. For those, weight prediction is computed here from SGD's
momentum buffer and PipeMare's delta is tracked here, with the formulas of ALGORITHMS.md.
All lists are in *module parameter order* (the stage's WeightStore order), whatever order the
optimizer's param groups use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["OptimizerBridge"]


def _is_engine_optimizer(opt: Any) -> bool:
    return hasattr(opt, "predicted_weights") and hasattr(opt, "backward_weights")


class OptimizerBridge:
    """Wraps one stage optimizer whose params are the stage's shadow parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, shadow: list[torch.nn.Parameter]) -> None:
        self.opt = optimizer
        self.shadow = shadow
        index = {id(p): i for i, p in enumerate(shadow)}
        self.order: list[int] = []  # optimizer (requires-grad) order -> module index
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in index:
                    raise ValueError(
                        "the stage optimizer holds a tensor that is not one of the parameters the "
                        "pipeline passed to the optimizer factory; build it from the params argument "
                        "(e.g. optimizer=lambda params: engine.optim.SGD(params, lr=0.1))"
                    )
                if p.requires_grad:
                    self.order.append(index[id(p)])
        self.is_engine = _is_engine_optimizer(optimizer)
        self._delta: list[Tensor] | None = None  # fallback T2 delta (torch.optim only)
        self._fallback_t2 = False
        self._decay = 0.1
        self.delay = 0

    # ------------------------------------------------------------------ options

    def set_delay(self, delay: int) -> None:
        """Tell the optimizer its stage's D_s (engine.optim reads group["delay"])."""
        self.delay = int(delay)
        for group in self.opt.param_groups:
            group["delay"] = int(delay)

    def group_option(self, key: str) -> Any:
        """The option's value if every group agrees, else raise (mixed settings per stage are
        ambiguous for the runtime's weight policy)."""
        values = {repr(g.get(key)) for g in self.opt.param_groups}
        if len(values) > 1:
            raise ValueError(f"param groups of one stage disagree on {key!r}: {sorted(values)}")
        return self.opt.param_groups[0].get(key) if self.opt.param_groups else None

    def enable_fallback_correction(self, decay: float) -> None:
        """Track PipeMare's delta here (the optimizer does not keep one)."""
        self._fallback_t2 = True
        self._decay = decay

    @property
    def keeps_delta(self) -> bool:
        return self.is_engine and bool(self.group_option("discrepancy_correction"))

    # ------------------------------------------------------------------ weights

    def _to_module_order(self, values: list[Tensor]) -> list[Tensor]:
        out: list[Tensor] = [p.detach() for p in self.shadow]
        for i, v in zip(self.order, values, strict=True):
            out[i] = v
        return out

    def predicted(self, horizon: float | None, mode: str = "linear") -> list[Tensor]:
        """w_hat = w - lr * H * v (``linear``) or w - lr * (m + ... + m^H) * v (``momentum``)."""
        if self.is_engine:
            return self._to_module_order(self.opt.predicted_weights(horizon=horizon))
        h = float(self.delay if horizon is None else horizon)
        out: list[Tensor] = []
        for p in self.shadow:
            group = next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))
            buf = self.opt.state.get(p, {}).get("momentum_buffer")
            if buf is None or h == 0:
                out.append(p.detach().clone())
                continue
            m = float(group.get("momentum", 0.0))
            coeff = h if mode == "linear" else sum(m**j for j in range(1, int(h) + 1))
            lr = float(group["lr"]) * float(group.get("lr_scale", 1.0))
            out.append(p.detach() - lr * coeff * buf)
        return out

    def backward_weights(self) -> list[Tensor]:
        """PipeMare T2's w - tau_s * delta (live weights where no delta is kept)."""
        if self.is_engine and self.keeps_delta:
            return self._to_module_order(self.opt.backward_weights())
        if self._delta is None:
            return [p.detach() for p in self.shadow]
        return [p.detach() - self.delay * d for p, d in zip(self.shadow, self._delta, strict=False)]

    # ------------------------------------------------------------------ update

    def step(self) -> None:
        """One optimizer step (plus the fallback delta update when the runtime tracks it)."""
        if not self._fallback_t2 or self.delay == 0:
            self.opt.step()
            return
        before = [p.detach().clone() for p in self.shadow]
        self.opt.step()
        gamma = self._decay ** (1.0 / self.delay)
        if self._delta is None:
            self._delta = [torch.zeros_like(b) for b in before]
        with torch.no_grad():
            for d, b, p in zip(self._delta, before, self.shadow, strict=False):
                d.mul_(gamma).add_(p.detach() - b, alpha=1.0 - gamma)

    # ------------------------------------------------------------------ state

    def extra_state(self) -> dict[str, Tensor]:
        """Runtime-owned optimizer state (the fallback delta) for checkpoints."""
        if self._delta is None:
            return {}
        return {f"delta.{i}": d for i, d in enumerate(self._delta)}

    def load_extra_state(self, tensors: dict[str, Tensor]) -> None:
        if not tensors:
            self._delta = None
            return
        self._delta = [tensors[f"delta.{i}"].clone() for i in range(len(self.shadow))]
