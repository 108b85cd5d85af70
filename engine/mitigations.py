"""The delay options of every engine optimizer, in one object: names, defaults, checks.

Why one object: SGD, Adam, AdamW, NAdam and Muon take the same keywords for delay and its
mitigations (ALGORITHMS.md); written once here -- each keyword's default and the check of its
value -- a keyword cannot differ between two optimizers, and the pipeline's options
(:mod:`engine.runtime.setup.config`), the command line (:mod:`engine.cli.config`) and the
ranks' settings agreement (:mod:`engine.runtime.ranks.agreement`) read the same lists. Each
optimizer's constructor takes the keywords (:func:`engine.optim.options.takes_delay_options`
writes them into its signature) and every param group is checked by :meth:`DelayOptions.check`.
Torch-free, so the command line reads it without importing torch. Which schedules the
mitigations apply to is a schedule fact: :attr:`engine.schedule.catalog.Family.live_async`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, ClassVar

__all__ = ["DelayOptions", "MITIGATION_OPTIONS", "PREDICTION_MODES", "WEIGHT_PREDICTIONS",
           "is_real_number"]

#: values of ``Pipeline(weight_prediction=...)`` and of ``train --prediction``: which weights
#: the forwards read (the pipeline's switch, docs/DESIGN.md "One switch per mitigation")
WEIGHT_PREDICTIONS: tuple[str, ...] = ("lwp", "spectrain", "spectrain_reuse")

#: values of the optimizers' ``prediction`` option: how the weights are extrapolated
PREDICTION_MODES: tuple[str, ...] = ("linear", "momentum")


def is_real_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class DelayOptions:
    """The delay keywords of an engine optimizer, with their defaults (per param group, like
    ``lr``: the pipeline writes each stage's ``delay``, a group may override any of them).
    What each means: ``engine.optim.SGD``'s docstring and ALGORITHMS.md."""

    delay: int = 0
    spike_compensation: bool = False
    prediction: str | None = None
    prediction_horizon: float | None = None
    discrepancy_correction: bool = False
    correction_decay: float = 0.1
    delay_compensation: float = 0.0

    #: the options that mitigate delay, each off when None, False or 0
    MITIGATIONS: ClassVar[tuple[str, ...]] = (
        "spike_compensation", "prediction", "discrepancy_correction", "delay_compensation")

    def group(self, without: tuple[str, ...] = ()) -> dict[str, Any]:
        """The options as param-group entries (``without``: keywords an optimizer lacks)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in without}

    @staticmethod
    def check(group: dict[str, Any], where: str) -> None:
        """Raise naming the option, its value and ``where`` (the group) if a delay option of
        ``group`` is out of range (``delay_compensation`` may be absent: 0)."""
        delay = group["delay"]
        if not isinstance(delay, numbers.Integral) or isinstance(delay, bool):
            raise TypeError(
                f"{where}delay={delay!r} is invalid: the delay is a whole number of updates (an int >= 0)"
            )
        if delay < 0:
            raise ValueError(
                f"{where}delay={delay!r} is invalid: the delay counts updates applied between a forward "
                "and the update of its gradient, so it must be >= 0"
            )
        mode = group["prediction"]
        if mode is not None and mode not in PREDICTION_MODES:
            raise ValueError(
                f"{where}prediction={mode!r} is not a prediction mode; valid values are None, "
                + ", ".join(repr(m) for m in PREDICTION_MODES)
            )
        horizon = group["prediction_horizon"]
        if horizon is not None and not (is_real_number(horizon) and horizon >= 0 and math.isfinite(horizon)):
            raise ValueError(
                f"{where}prediction_horizon={horizon!r} is invalid: use None (the group's delay) or a number >= 0"
            )
        if mode == "momentum" and horizon is not None and int(horizon) != horizon:
            raise ValueError(
                f"{where}prediction_horizon={horizon!r} is invalid for prediction='momentum': it "
                "sums m + m^2 + ... + m^H, so H must be a whole number (or use 'linear')"
            )
        decay = group["correction_decay"]
        if not (is_real_number(decay) and 0.0 < decay < 1.0):
            raise ValueError(
                f"{where}correction_decay={decay!r} is invalid: PipeMare's D_decay must lie in (0, 1) "
                "(gamma = D_decay ** (1 / delay))"
            )
        lam = group.get("delay_compensation", 0.0)
        if not (is_real_number(lam) and math.isfinite(lam) and lam >= 0.0):
            raise ValueError(
                f"{where}delay_compensation={lam!r} is invalid: it is DC-ASGD's lambda in "
                "g + lambda * g * g * (w_t - w_(t-tau)), a finite number >= 0 (0 turns it off)"
            )


#: the engine optimizer options that mitigate gradient delay (ALGORITHMS.md)
MITIGATION_OPTIONS: tuple[str, ...] = DelayOptions.MITIGATIONS
