"""One stage per process (gloo/NCCL): running a rank's step programs.

Why a module of its own: under ``torchrun`` a process holds only its own stage (built by
:func:`~engine.runtime.ranks.rank_build.build_rank`), runs only its stage's list of each
compiled step program -- sends and receives through the blocking point-to-point transport --
and meets the other ranks for three things (:mod:`engine.runtime.ranks.distributed`): the shape
handshake at the first step, the step's loss (sent by the last stage to every rank of its
replica), and the data-parallel all-reduce of the flat gradient buffers.

A synchronous step runs the stage's forwards, backwards and communication, then the loss
check (on every rank, from the shared loss message), then its update; an asynchronous step
runs the whole list. The weights after any number of steps equal the local run's bit for bit
on CPU: every rank executes exactly its stage's actions of the same compiled programs.
With virtual stages (interleaved 1F1B) a rank builds and runs its v stages, their actions
merged in the schedule's rank order (:mod:`engine.runtime.ranks.virtual`).
"""

from __future__ import annotations

from typing import Any

from engine.runtime.ranks.lane import RankLane
from engine.runtime.exec.protocol import StepProtocol

__all__ = ["RankExecutor"]


class RankExecutor(StepProtocol):
    """The step protocol on one rank: its stage's op list with blocking communication (with
    virtual stages: its stages' lists merged in the schedule's rank order, ``lane``)."""

    def __init__(
        self, *args: Any, rank: Any, transports: dict[int, Any], lane: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.immediate_nonfinite = False  # checked once per step, on every rank
        #: asynchronous float16: gradients carry their loss scale (runtime/precision.py; set by attach)
        self.carry_scales = False
        self.rank = rank
        self.transport = rank.transport
        self.transports = transports  # stage -> its transport
        self.runner: RankLane = RankLane(self, rank, transports, lane)
        lay = rank.layout
        # a user stage that raises mid-step is rolled back on every rank (synchronous) or its
        # micro-batch dropped (asynchronous gloo), with abort/dropped frames
        # (transport/abort.py; under NCCL zeros and the verdict: lane.py): steps of one
        # replica, one stage per rank
        backend = getattr(rank.transport, "backend", None)
        frames = (
            backend in ("gloo", "nccl") and lay.replicas == 1
            and len(transports) == 1 and hasattr(rank.transport, "send_abort")
            and lay.last_rank != lay.pipeline_ranks[0]
        )
        rank.relay = self.runner.aborts = frames and self.sync
        # an asynchronous step drops the micro-batch of an action that raised, as locally
        self.runner.drops = frames and not self.sync and backend == "gloo"
        # NCCL cannot: the step completes its communication with zeros, every rank raises
        self.runner.async_abort = frames and not self.sync and backend == "nccl"

    def wire_state(self) -> dict[str, Any]:
        """The lane's messages at a step boundary, for the in-flight state (RankLane.wire_state)."""
        return self.runner.wire_state()

    def load_wire_state(self, state: dict[str, Any]) -> None:
        self.runner.load_wire_state(state)
