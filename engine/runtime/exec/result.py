"""What a step hands back (:class:`StepResult`) and what it keeps of each fed micro-batch
(:class:`_Input`).

Why a module of its own: the step protocol's pieces (the executor, its synchronous-step and
failure mixins, a rank's executor, the in-flight state) all name these records; kept in the
executor module, the mixins the executor imports had to import it back (an import circle).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

__all__ = ["StepResult"]


@dataclasses.dataclass
class _Input:
    x: Any
    target: Any
    samples: int
    readers: int  # local stages (0 and/or S-1) that still have to read it


@dataclasses.dataclass
class StepResult:
    """Sample-weighted mean loss of the micro-batches whose forward completed (None if none)
    and how many of them had a non-finite loss."""

    loss: Tensor | None
    nonfinite: int = 0
    bad: list[int] = dataclasses.field(default_factory=list)  # global ids of non-finite ones
