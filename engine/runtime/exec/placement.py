"""Which rank of a multi-process pipeline holds which stage: round-robin, the V, or any map.

Why a module of its own: one stage per process needs no map (stage s on rank s), and
interleaved 1F1B puts virtual stage s on rank s % R. A program with a ``placement``
(:mod:`engine.schedule.ir`: the V of ZB-V and DualPipeV, where rank r holds r and 2R-1-r, or
any map a CSV implies) breaks three things that round-robin made true by construction, and
every one of them is answered here instead of by ``s % R`` scattered through the runtime:

* the first and the last stage may sit on any rank (the V puts both on rank 0): the inputs go
  to :attr:`RankPlacement.first`, the targets and the loss message come from
  :attr:`RankPlacement.last`;
* two neighbouring stages may sit on the same rank (the V's bottom, stages R-1 and R on rank
  R-1; contiguous blocks): that boundary gets no process group and its activations and
  gradients are handed over in the process (:mod:`engine.runtime.ranks.transport.local_link`);
* a tied parameter's holders and the evaluation path follow the map.

Positions are indices into the replica's pipeline (``Layout.pipeline_ranks``), so the map is
the same in every data-parallel replica.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RankPlacement"]


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """``owner[s]``: the pipeline position (rank within the replica) that holds stage s."""

    owner: tuple[int, ...]
    ranks: int

    @classmethod
    def of(cls, spec: Any) -> RankPlacement:
        """The map of a resolved ScheduleSpec: the program's placement (or round-robin) for
        programs with a rank order, stage s on rank s otherwise."""
        program = spec.program
        S = spec.stages
        if program is None or program.rank_order is None:
            return cls(tuple(range(S)), S)
        return cls(tuple(program.rank_of(s) for s in range(S)), program.ranks)

    @property
    def stages(self) -> int:
        return len(self.owner)

    def rank_of(self, stage: int) -> int:
        return self.owner[stage]

    def held(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order (the order its handshake runs)."""
        return [s for s, r in enumerate(self.owner) if r == rank]

    @property
    def first(self) -> int:
        """The position that runs stage 0 and reads the inputs."""
        return self.owner[0]

    @property
    def last(self) -> int:
        """The position that runs the last stage, reads the targets and sends the loss."""
        return self.owner[-1]

    def same_rank(self, boundary: int) -> bool:
        """Whether stages ``boundary`` and ``boundary + 1`` are held by one rank."""
        return self.owner[boundary] == self.owner[boundary + 1]

    @property
    def round_robin(self) -> bool:
        return all(r == s % self.ranks for s, r in enumerate(self.owner))

    def describe(self) -> str:
        return str([self.held(r) for r in range(self.ranks)])
