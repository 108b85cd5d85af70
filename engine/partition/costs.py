"""The exact cost model: what a layer costs, and what a stage of layers costs under a schedule.

Why this is its own file: the solver, the profiler and :func:`stage_costs` (which reports a
given balance) all speak in these types, and the memory formula below is the one thing a
memory cap is compared with, so it lives in one place. It needs no torch.

Memory of stage s holding layers i..j-1 (``P`` parameter bytes, ``Buf`` buffer bytes, ``A``
activation bytes of one micro-batch, all summed over the layers; ``versions_s`` and
``activations_s`` from :func:`engine.partition.footprint.stage_footprint`)::

    memory = P * (versions_s + 1 gradient) + ceil(P * optimizer_state_factor) + Buf
             + A * activations_s

``optimizer_state_factor`` counts optimizer buffers per parameter element of the same dtype:
0 for plain SGD, 1 for SGD with momentum, 2 for Adam/AdamW (the default: a safe upper bound);
add 1 for PipeMare's discrepancy-correction delta or a materialised weight prediction.
Activation bytes per layer are the tensors autograd saves for backward (parameters excluded,
shared storage counted once) plus the layer's output; summing them over a stage is an upper
bound (a layer's output is often also what the next layer saves), which is the safe side
for a cap.

Exact arithmetic: times are converted to exact integers (every float is a dyadic rational, so
scaling by the largest denominator is lossless) and memory is counted in whole bytes, so
comparisons never depend on floating-point summation order, and a brute force over all splits
finds exactly the same answer as the solver (the tests check this).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from engine.partition.footprint import stage_footprint

__all__ = ["OPTIMIZER_STATE_FACTORS", "LayerCost", "StageCost", "stage_costs"]

#: optimizer buffers per parameter element, by name (a number may be given instead)
OPTIMIZER_STATE_FACTORS: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "nadam": 2}


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs per micro-batch.

    ``forward_time`` / ``backward_time`` in seconds; ``param_bytes`` of its parameters;
    ``activation_bytes`` it keeps alive per micro-batch until its backward (saved tensors plus
    output); ``buffer_bytes`` of its buffers (held once, no gradient or optimizer state).
    """

    forward_time: float
    backward_time: float
    param_bytes: int
    activation_bytes: int
    buffer_bytes: int = 0
    name: str = ""

    @property
    def time(self) -> float:
        """Forward plus backward time."""
        return self.forward_time + self.backward_time


@dataclass(frozen=True)
class StageCost:
    """One stage of a balance: its layers, time, memory and what its schedule makes it hold."""

    stage: int
    layers: range
    time: float
    memory_bytes: int
    param_bytes: int
    activation_bytes: int
    buffer_bytes: int
    versions: int
    activations_held: int

    def describe(self, optimizer_state: Fraction | int) -> str:
        first, last = self.layers[0], self.layers[-1]
        span = f"layer {first}" if first == last else f"layers {first}..{last}"
        return (
            f"stage {self.stage} ({span}): {self.param_bytes} B weights x ({self.versions} "
            f"version{'s' if self.versions != 1 else ''} + 1 gradient + {_fmt_factor(optimizer_state)} "
            f"optimizer state) + {self.buffer_bytes} B buffers + {self.activation_bytes} B "
            f"activations x {self.activations_held} micro-batch"
            f"{'es' if self.activations_held != 1 else ''} = {self.memory_bytes} B"
        )


# ----------------------------------------------------------------------------- formatting and argument checks


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _fmt_factor(f: Fraction | int) -> str:
    f = Fraction(f)
    return str(f.numerator) if f.denominator == 1 else f"{float(f):g}"


def _optimizer_factor(value: object) -> Fraction:
    if isinstance(value, str):
        key = value.lower()
        if key not in OPTIMIZER_STATE_FACTORS:
            raise ValueError(
                f"unknown optimizer_state_factor {value!r}; use a number of buffers per "
                f"parameter or one of {', '.join(OPTIMIZER_STATE_FACTORS)}"
            )
        return Fraction(OPTIMIZER_STATE_FACTORS[key])
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
        raise TypeError(f"optimizer_state_factor must be a number or a name, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"optimizer_state_factor must be finite and >= 0, got {value!r}")
    # a float is read as the decimal it prints as (0.005 means 1/200, not the binary double
    # just above it), so a factor typed by a user rounds as they expect
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


def _check_costs(costs: Sequence[LayerCost]) -> list[LayerCost]:
    out = list(costs)
    if not out:
        raise ValueError("costs is empty: there are no layers to partition")
    for k, c in enumerate(out):
        if not isinstance(c, LayerCost):
            raise TypeError(f"costs[{k}] is a {type(c).__name__}, not a LayerCost")
        for field in ("forward_time", "backward_time"):
            v = getattr(c, field)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise ValueError(f"costs[{k}].{field} = {v!r}: must be a finite number >= 0")
        for field in ("param_bytes", "activation_bytes", "buffer_bytes"):
            v = getattr(c, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"costs[{k}].{field} = {v!r}: must be an int >= 0 (bytes)")
    return out


# ----------------------------------------------------------------------------- the model


class _Model:
    """Exact integer prefix sums and per-stage cost functions for one problem."""

    def __init__(
        self,
        costs: list[LayerCost],
        footprint: list[tuple[int, int]],
        factor: Fraction,
    ) -> None:
        ratios = [Fraction(c.forward_time) + Fraction(c.backward_time) for c in costs]
        self.denominator = max(r.denominator for r in ratios)  # a power of two
        self.time_prefix = [0]
        self.param_prefix = [0]
        self.act_prefix = [0]
        self.buf_prefix = [0]
        for r, c in zip(ratios, costs, strict=True):
            self.time_prefix.append(
                self.time_prefix[-1] + r.numerator * (self.denominator // r.denominator)
            )
            self.param_prefix.append(self.param_prefix[-1] + c.param_bytes)
            self.act_prefix.append(self.act_prefix[-1] + c.activation_bytes)
            self.buf_prefix.append(self.buf_prefix[-1] + c.buffer_bytes)
        self.footprint = footprint
        self.factor = factor

    def time(self, s: int, i: int, j: int) -> int:  # noqa: ARG002 - same shape as memory
        return self.time_prefix[j] - self.time_prefix[i]

    def memory(self, s: int, i: int, j: int) -> int:
        versions, held = self.footprint[s]
        P = self.param_prefix[j] - self.param_prefix[i]
        A = self.act_prefix[j] - self.act_prefix[i]
        B = self.buf_prefix[j] - self.buf_prefix[i]
        f = self.factor
        opt = -(-(P * f.numerator) // f.denominator)  # ceil(P * factor), exact
        return P * (versions + 1) + opt + B + A * held

    def seconds(self, t: int) -> float:
        return float(Fraction(t, self.denominator))

    def stage(self, s: int, i: int, j: int) -> StageCost:
        versions, held = self.footprint[s]
        return StageCost(
            stage=s,
            layers=range(i, j),
            time=self.seconds(self.time(s, i, j)),
            memory_bytes=self.memory(s, i, j),
            param_bytes=self.param_prefix[j] - self.param_prefix[i],
            activation_bytes=self.act_prefix[j] - self.act_prefix[i],
            buffer_bytes=self.buf_prefix[j] - self.buf_prefix[i],
            versions=versions,
            activations_held=held,
        )


def stage_costs(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    *,
    schedule: str = "1f1b",
    chunks: int,
    optimizer_state_factor: float | str = 2,
    order: str | None = None,
) -> list[StageCost]:
    """Time and memory of every stage of ``balance`` under ``schedule`` (same model as
    :func:`engine.partition.partition` uses; ``memory_bytes`` is what the memory cap is compared with)."""
    layers = _check_costs(costs)
    bal = _check_balance(balance, len(layers), what="layers")
    model = _Model(
        layers,
        stage_footprint(schedule, len(bal), chunks, order=order),
        _optimizer_factor(optimizer_state_factor),
    )
    out = []
    i = 0
    for s, n in enumerate(bal):
        out.append(model.stage(s, i, i + n))
        i += n
    return out


# ----------------------------------------------------------------------------- balances


def _check_balance(balance: object, n: int, *, what: str) -> list[int]:
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance must be a list of layer counts per stage, got {balance!r}")
    bal = list(balance)
    if not bal:
        raise ValueError(f"balance is empty: give at least one stage, e.g. balance=[{n}]")
    for s, v in enumerate(bal):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(
                f"balance[{s}] = {v!r} is not an int: stage {s} needs a whole number of {what}"
            )
        if v < 1:
            raise ValueError(
                f"balance[{s}] = {v}: stage {s} needs at least one of the {n} {what}; "
                f"use fewer stages or move {what} into it"
            )
    total = sum(bal)
    if total != n:
        raise ValueError(
            f"balance {bal} covers {total} {what} but there are {n}; "
            f"{'remove' if total > n else 'add'} {abs(total - n)} so that it sums to {n}"
        )
    return bal
