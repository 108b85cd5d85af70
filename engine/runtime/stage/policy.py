"""Weight policies: which weights a stage's forward and backward of micro-batch i read.

One class per row of ALGORITHMS.md's "Weight versions" table. A policy only *names* the
weights, as a buffer of the stage's :class:`~engine.runtime.stage.weight_store.WeightStore`: the
live weights, a kept version (pinned by the micro-batches that read it), or the store's one
*transient* buffer filled with computed values (a prediction, PipeMare's corrected weights).
The stage turns that into ``store.use(buffer)`` around the forward and the backward; nothing
is copied per micro-batch.

Policies read the stage through :class:`StageView` (update count, forwards run so far,
segment origin), never the other way round, so this module does not import the stage.

``remaps_saved_weights`` is True when, without recomputation, the weights autograd saved at
the forward must resolve to *another* buffer at the backward (LWP: F on the prediction, B on
the live weights; PipeMare T2: F on live, B on the corrected weights). The stage then
installs the saved-tensor hooks of :mod:`~engine.runtime.stage.saved_weights`, which is what keeps
these methods at one live version plus one transient for every recomputation mode.
"""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "StageView",
    "Transient",
    "WeightPolicy",
    "LiveWeights",
    "Stashing",
    "DoubleBuffered",
    "PipelinedBackprop",
    "LinearWeightPrediction",
    "SpecTrain",
    "DiscrepancyCorrection",
    "make_policy",
    "spectrain_horizons",
]

#: buffer names a policy returns (resolved by the stage against its store)
LIVE = "live"
PINNED = "pinned"  # the version the forward pinned (same weights for the backward)


class StageView(Protocol):
    """What a policy may read of a stage."""

    index: int
    num_stages: int
    updates: int  # t: updates applied so far
    segment_updates: int  # updates applied when the current segment started
    forwards: int  # forwards run in the current segment (the next one's index)


class Transient:
    """A request for the stage's transient buffer holding computed weights.

    ``kind`` is ``"predict"`` (w - c * direction with horizon ``horizon``) or ``"correct"``
    (PipeMare's w - tau * delta). Two requests with equal (kind, horizon) at the same update
    count name the same values, so the store computes them at most once per update."""

    __slots__ = ("kind", "horizon")

    def __init__(self, kind: str, horizon: float | None = None) -> None:
        self.kind = kind
        self.horizon = horizon

    def key(self) -> tuple[str, float | None]:
        return (self.kind, self.horizon)

    def __repr__(self) -> str:
        return f"Transient({self.kind!r}, {self.horizon!r})"


def spectrain_horizons(s: int, S: int) -> tuple[int, int]:
    """SpecTrain's (s_F, s_B) for stage s of S (paper version; stage index plays GPU k)."""
    return s // 2 + S - s - 1, s // 2


class WeightPolicy:
    """Base: F and B read the live weights and nothing is kept."""

    name = "base"
    #: the forward's buffer is pinned until its backward (weight stashing)
    pins_forward = False
    remaps_saved_weights = False

    def forward(self, stage: StageView) -> str | int | Transient:
        """LIVE, a version number to read (pinned until B), or a Transient request."""
        return LIVE

    def backward(self, stage: StageView) -> str | Transient:
        """LIVE, PINNED (what the forward read) or a Transient request."""
        return LIVE

    def version_read(self, stage: StageView) -> int:
        """t_F: the update count the forward's weights derive from (ALGORITHMS.md)."""
        return stage.updates

    def keep_live_at_update(self, stage: StageView) -> bool:
        """Whether a future forward reads the version the next update replaces (2BW)."""
        return False

    def prediction_key(self, stage: StageView) -> tuple[str, float | None] | None:
        """The transient request the optimizer's fused step should fill after an update
        (the forward's prediction), or None when no forward reads a prediction."""
        return None


class LiveWeights(WeightPolicy):
    """Synchronous schedules: F and B both read w_t (no update happens in between)."""

    name = "sync"


class Stashing(WeightPolicy):
    """PipeDream: F reads w_{t_F} and pins it; B reads the same stashed version."""

    name = "pipedream"
    pins_forward = True

    def forward(self, stage: StageView) -> str | int | Transient:
        return stage.updates

    def backward(self, stage: StageView) -> str | Transient:
        return PINNED


class DoubleBuffered(WeightPolicy):
    """PipeDream-2BW: the forward of segment micro-batch i reads version
    max(floor(i/M) - 1, 0) (counted from the segment's start); B reads the same version."""

    name = "2bw"
    pins_forward = True

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    def _version(self, stage: StageView, i: int) -> int:
        return stage.segment_updates + max(i // self.chunks - 1, 0)

    def forward(self, stage: StageView) -> str | int | Transient:
        return self._version(stage, stage.forwards)

    def version_read(self, stage: StageView) -> int:
        return self._version(stage, stage.forwards)

    def backward(self, stage: StageView) -> str | Transient:
        return PINNED

    def keep_live_at_update(self, stage: StageView) -> bool:
        return self._version(stage, stage.forwards) == stage.updates


class PipelinedBackprop(WeightPolicy):
    """pb: F reads w_{t_F}, B reads the live w_{t_B}."""

    name = "pb"


class LinearWeightPrediction(WeightPolicy):
    """LWP (Kosson et al.): F reads the optimizer's prediction (horizon: the optimizer's
    ``prediction_horizon``, else D_s), B the live weights."""

    name = "lwp"
    remaps_saved_weights = True

    def forward(self, stage: StageView) -> str | int | Transient:
        return Transient("predict", None)

    def prediction_key(self, stage: StageView) -> tuple[str, float | None] | None:
        return ("predict", None)  # horizon: the optimizer's own default


class SpecTrain(WeightPolicy):
    """SpecTrain (Chen et al.): F reads w - s_F * lr * v, B reads w_{t_B} - s_B * lr * v_{t_B}.

    ``reuse=True`` is the paper's second variant: s_F = N - k - 1 and B reuses the forward's
    predicted weights (the prediction is then pinned like a stashed version)."""

    name = "spectrain"

    def __init__(self, num_stages: int, stage: int, reuse: bool = False) -> None:
        self.reuse = reuse
        if reuse:
            self.name = "spectrain_reuse"
            self.s_f, self.s_b = num_stages - stage - 1, 0
        else:
            self.s_f, self.s_b = spectrain_horizons(stage, num_stages)
        self.pins_forward = reuse
        # with s_B = 0 the backward reads the live weights, not the transient the forward read
        self.remaps_saved_weights = not reuse and self.s_b == 0

    def forward(self, stage: StageView) -> str | int | Transient:
        return Transient("predict", float(self.s_f))

    def backward(self, stage: StageView) -> str | Transient:
        if self.reuse:
            return PINNED
        if self.s_b == 0:
            return LIVE
        return Transient("predict", float(self.s_b))

    def prediction_key(self, stage: StageView) -> tuple[str, float | None] | None:
        return ("predict", float(self.s_f))


class DiscrepancyCorrection(WeightPolicy):
    """PipeMare T2: F reads w_{t_F}; B reads w_{t_B} - tau_s * delta_{t_B}."""

    name = "pipemare_t2"
    remaps_saved_weights = True

    def backward(self, stage: StageView) -> str | Transient:
        return Transient("correct")


def make_policy(
    weights: str,
    synchronous: bool,
    chunks: int,
    num_stages: int,
    stage: int,
    prediction: str | None,
    correction: bool,
) -> WeightPolicy:
    """The policy of one stage for a validated (schedule, mitigation) combination."""
    if synchronous:
        return LiveWeights()
    if weights == "stash":
        return Stashing()
    if weights == "2bw":
        return DoubleBuffered(chunks)
    if prediction == "lwp":
        return LinearWeightPrediction()
    if prediction in ("spectrain", "spectrain_reuse"):
        return SpecTrain(num_stages, stage, reuse=prediction == "spectrain_reuse")
    if correction:
        return DiscrepancyCorrection()
    return PipelinedBackprop()
