"""What a pipeline is made of: the builders' input (:class:`BuildRequest`) and output
(:class:`PipelineParts`).

Why a module: ``Pipeline(...)`` checks its options and calls one builder --
:func:`~engine.runtime.assemble.build_local` (every stage in this process) or
:func:`~engine.runtime.ranks.rank_build.build_rank` (gloo/NCCL: this rank's stages) -- which
*returns* the parts, as torchtitan's ``pipeline_module_split`` returns its stages and models.
The facade holds them and delegates; nothing below it writes into the facade or imports it.
The state dict, the in-flight state, evaluation, statistics and a rank's step take the parts
(or the few of them they need), so ``engine.runtime.pipeline`` stays a leaf of the import graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.errors import NotFlushedError
from engine.runtime.precision import autocast_context

if TYPE_CHECKING:
    from engine.runtime.capture.synchronous import ProgramCapture
    from engine.runtime.setup.config import PipelineConfig
    from engine.runtime.exec.executor import Executor
    from engine.runtime.setup.l2 import L2State
    from engine.runtime.stage.stage import Stage
    from engine.runtime.setup.step_features import StepFeatures
    from engine.runtime.exec.streams import StageStreams
    from engine.schedule.spec import ScheduleSpec

__all__ = ["BuildRequest", "PipelineParts"]


@dataclass(frozen=True)
class BuildRequest:
    """The construction arguments a builder reads, as the user gave them (``Pipeline``'s
    docstring says what each means), with the options the facade already validated."""

    stages: Any
    schedule: Any
    chunks: int | None
    loss_fn: Callable[[Tensor, Any], Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    config: PipelineConfig
    features: StepFeatures
    update_size: int | None = None
    order: str | None = None
    balance: Any = None
    weight_prediction: str | None = None
    discrepancy_correction: bool | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    num_stages: int | None = None
    sample: Any = None
    memory_cap_bytes: float | None = None
    balance_repeats: int = 3
    balance_profile: Any = None
    deferred_batch_norm: bool = False
    virtual_stages: int | None = None
    ties: Any = None  #: the user's declared ties (``Pipeline(ties=...)``)
    mesh: Any = None  #: a DeviceMesh with pp/dp/tp dimensions (engine/runtime/ranks/mesh.py)


@dataclass(eq=False)
class PipelineParts:
    """A built pipeline: what a builder returns and the facade holds (one process's share of
    it under gloo/NCCL: its stages, its executor, its rank's communication)."""

    spec: ScheduleSpec
    config: PipelineConfig
    features: StepFeatures
    stages: list[Stage]
    executor: Executor
    streams: StageStreams
    l2: L2State
    #: D_s per stage (all S, also on a rank that holds one), set on the optimizers
    delays: list[int]
    weight_prediction: str | None
    discrepancy_correction: bool
    device: torch.device
    #: layer counts per stage when ``stages`` was an nn.Sequential
    balance: list[int] | None = None
    #: tied parameters, one list of (stage, name) per tie (engine/runtime/ties/groups.py)
    ties: list[Any] = field(default_factory=list)
    #: cuda_graphs="program": whole steps replayed from graphs (engine/runtime/capture/synchronous.py)
    capture: ProgramCapture | None = None
    #: gloo/NCCL: the replica x stage layout (a transport.layout.Layout: rank, stage, replica,
    #: groups) and this rank's communication (distributed.RankRuntime or
    #: virtual.VirtualRankRuntime). Typed loosely on purpose: the parts sit below the
    #: multi-process wing that builds them, so they do not import it.
    layout: Any = None
    replicas: int = 1
    rank: Any = None
    #: gloo/NCCL evaluation: this replica's process group, created at the first evaluate()
    eval_group: Any = None

    @property
    def runner(self) -> Any:
        """What runs a step: the program capture when on, else the executor."""
        return self.capture if self.capture is not None else self.executor

    @property
    def flushed(self) -> bool:
        """True when no micro-batch is in flight and no gradient is pending."""
        return self.executor.in_flight() == 0

    def require_flushed(self, what: str) -> None:
        if not self.flushed:
            raise NotFlushedError(
                f"{what} needs a flushed pipeline, but micro-batches of {self.spec.describe()} "
                "are in flight; call pipe.flush() first"
            )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The stages' ``torch.autocast`` (``Pipeline(autocast=...)``), or nothing."""
        a = self.stages[0].autocast if self.stages else None
        return autocast_context(*a) if a is not None else contextlib.nullcontext()
