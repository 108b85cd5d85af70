"""Weight policies: which weights a stage's forward and backward of micro-batch n read.

One class per row of ALGORITHMS.md's "Weight versions" table. A policy only *names* the
weights (live, a stored version, or computed values); the stage turns that into buffers of
its WeightStore (see stage.py for how F/B storage is chosen so that autograd reads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from engine.runtime.plan import spectrain_horizons

if TYPE_CHECKING:
    from engine.runtime.stage import Stage

__all__ = [
    "WeightPolicy",
    "LiveWeights",
    "Stashing",
    "DoubleBuffered",
    "PipelinedBackprop",
    "LinearWeightPrediction",
    "SpecTrain",
    "DiscrepancyCorrection",
    "make_policy",
]


class WeightPolicy:
    """Base policy. ``forward_kind``: "live" | "version" | "values"; ``backward_kind``:
    "same" (the forward's weights) | "live" (w_{t_B}) | "values" (computed at B time)."""

    name = "base"
    forward_kind = "live"
    backward_kind = "same"

    def forward_version(self, stage: Stage, i: int) -> int:
        """The update count the forward's weights derive from (t_F in ALGORITHMS.md)."""
        return stage.updates

    def forward_values(self, stage: Stage, i: int) -> list[Tensor]:  # pragma: no cover
        raise NotImplementedError

    def backward_values(self, stage: Stage, i: int) -> list[Tensor]:  # pragma: no cover
        raise NotImplementedError


class LiveWeights(WeightPolicy):
    """sync schedules: F and B both read w_t (no update happens in between)."""

    name = "sync"


class Stashing(WeightPolicy):
    """PipeDream: F reads w_{t_F}; B reads the same stashed version (pinned per micro-batch)."""

    name = "pipedream"
    forward_kind = "version"


class DoubleBuffered(WeightPolicy):
    """PipeDream-2BW: micro-batch i (of the segment) reads version max(floor(i/M) - 1, 0),
    counted from the update count at the segment start; B reads the same version."""

    name = "2bw"
    forward_kind = "version"

    def __init__(self, M: int) -> None:
        self.M = M

    def forward_version(self, stage: Stage, i: int) -> int:
        return stage.segment_updates + max(i // self.M - 1, 0)


class PipelinedBackprop(WeightPolicy):
    """pb: F reads w_{t_F}, B reads the live w_{t_B}."""

    name = "pb"
    backward_kind = "live"


class LinearWeightPrediction(WeightPolicy):
    """LWP (Kosson et al.): F reads w - lr * D_s * v (the optimizer's prediction), B live."""

    name = "lwp"
    forward_kind = "values"
    backward_kind = "live"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def forward_values(self, stage: Stage, i: int) -> list[Tensor]:
        # horizon None: the optimizer's own default (prediction_horizon, else its delay D_s)
        return stage.bridge.predicted(None, self.mode)


class SpecTrain(WeightPolicy):
    """SpecTrain (Chen et al.): F reads w - s_F * lr * v, B reads w_{t_B} - s_B * lr * v_{t_B}.

    ``reuse=True`` is the paper's second variant: s_F = N - k - 1 and B reuses the forward's
    predicted weights."""

    name = "spectrain"
    forward_kind = "values"
    backward_kind = "values"

    def __init__(self, S: int, mode: str, reuse: bool = False) -> None:
        self.S = S
        self.mode = mode
        self.reuse = reuse
        if reuse:
            self.name = "spectrain_reuse"
            self.backward_kind = "same"

    def horizons(self, s: int) -> tuple[int, int]:
        if self.reuse:
            return self.S - s - 1, 0
        return spectrain_horizons(s, self.S)

    def forward_values(self, stage: Stage, i: int) -> list[Tensor]:
        return stage.bridge.predicted(self.horizons(stage.index)[0], self.mode)

    def backward_values(self, stage: Stage, i: int) -> list[Tensor]:
        return stage.bridge.predicted(self.horizons(stage.index)[1], self.mode)


class DiscrepancyCorrection(WeightPolicy):
    """PipeMare T2: F reads w_{t_F}; B reads w_{t_B} - tau_s * delta_{t_B}."""

    name = "pipemare_t2"
    backward_kind = "values"

    def backward_values(self, stage: Stage, i: int) -> list[Tensor]:
        return stage.bridge.backward_weights()


def make_policy(
    schedule: str, M: int, S: int, prediction: str | None, mode: str, correction: bool
) -> WeightPolicy:
    """The policy for a validated (schedule, mitigation) combination."""
    if schedule in ("naive", "gpipe", "1f1b"):
        return LiveWeights()
    if schedule == "pipedream":
        return Stashing()
    if schedule == "2bw":
        return DoubleBuffered(M)
    if prediction == "lwp":
        return LinearWeightPrediction(mode)
    if prediction in ("spectrain", "spectrain_reuse"):
        return SpecTrain(S, mode, reuse=prediction == "spectrain_reuse")
    if correction:
        return DiscrepancyCorrection()
    return PipelinedBackprop()
