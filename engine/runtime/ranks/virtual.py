"""Virtual stages across processes (interleaved 1F1B under gloo/NCCL): v stages per rank.

Why a module of its own: with one stage per process (:mod:`engine.runtime.ranks.rank`) a rank has
one upstream and one downstream neighbour and all its traffic shares one process group. With
v virtual stages per rank (virtual stage s on rank s % R, so rank r holds r, r+R, r+2R, ...)
the same two ranks meet at several stage boundaries -- with R = 2 every boundary joins ranks 0
and 1, in both directions -- and gloo matches a receive to the first message of the same
(group, peer, tag). So every boundary b (between virtual stages b and b+1) gets its own
process group of its two ranks, and each virtual stage one transport per side
(:class:`VirtualStageTransport`): the *up* side on boundary s-1 (activations in, gradients
out), the *down* side on boundary s (activations out, gradients in). Under NCCL each
boundary gets two groups, one per channel direction (transport/nccl.py says why). Each side
is a plain :class:`~engine.runtime.ranks.transport.p2p.P2PTransport`, whose state is already per boundary
(the agreed Signature, the shapes each micro-batch travelled with, the sends it holds), so its
rules carry over unchanged: on one boundary messages travel in micro-batch order (a virtual
stage runs its forwards, and its backwards, in micro-batch order), which is what pre-posting
receives needs; and the release rule (a gradient has left once the previous stage sent a
later activation) reads the previous *virtual* stage's own stream, which the rank's merged
order preserves. The loss message and the handshake's agreement stay on the pipeline group.

The rank runs its stages' actions in the schedule's ``rank_order`` (``StepProgram.lanes``),
one at a time with blocking receives; the validator checks exactly that execution for
deadlocks. Gradients are flushed and applied per virtual stage, as in one process.

Placement: virtual stage s runs on rank s % R unless the program names a ``placement`` (the
V of ``zbv``/``dualpipev``: rank r holds r and 2R-1-r; or any map from a CSV), which
:class:`~engine.runtime.exec.placement.RankPlacement` reads. A boundary whose two stages one rank
holds (the V's bottom, contiguous blocks) gets no process group: its sides are the two ends
of a :class:`~engine.runtime.ranks.transport.local_link.LocalLink`, which hands the value over in
the process, exactly as the single-process executor does.

Supported: synchronous programs with a rank order (``schedule="interleaved"``, ``looped_bfs``,
``zbv``, ``dualpipev``, CSV imports), any placement, trees,
masks, variable shapes, tied weights, data-parallel replicas (each virtual stage's gradients
are all-reduced over its replicas at its update, in the same stage order on every replica).
Refused: asynchronous programs over virtual stages, and one rank per replica
(:func:`check_virtual`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from engine.errors import PipelineConfigError, PipelineInputError
from engine.runtime.ranks.distributed import RankRuntime
from engine.runtime.exec.placement import RankPlacement
from engine.runtime.ranks.transport.gloo import GlooTransport
from engine.runtime.ranks.transport.groups import GroupCalls, new_group
from engine.runtime.ranks.transport.layout import Layout
from engine.runtime.ranks.transport.local_link import LocalLink
from engine.runtime.ranks.transport.nccl import NCCLTransport
from engine.runtime.ranks.transport.p2p import P2PTransport
from engine.schedule.spec import ScheduleSpec

__all__ = ["check_virtual", "VirtualStageTransport", "VirtualRankRuntime", "virtual_transports"]


def check_virtual(spec: ScheduleSpec, data_parallel: int) -> int:
    """R, the ranks of a virtual-stage program under gloo/NCCL; PipelineConfigError naming
    the setting for what does not run across processes (before any weight exists)."""
    program = spec.program
    assert program is not None and program.rank_order is not None
    v, R = program.virtual_stages, program.ranks
    what = f"{spec.describe()} with virtual_stages={v}"
    if not spec.synchronous:
        raise PipelineConfigError(
            f"{what} is asynchronous; across processes virtual stages run synchronous programs "
            "only (schedule='interleaved'); use transport='local'"
        )
    if R < 2:
        raise PipelineConfigError(
            f"{what} puts all {spec.stages} stages on one rank of each replica "
            f"(data_parallel={data_parallel}); a pipeline across processes needs at least 2 "
            "ranks (stages / virtual_stages >= 2), or use transport='local'"
        )
    return R


class _GlooUpSide(GlooTransport):
    """The side that receives activations (gloo): an error it must pass downstream (a shape
    its stage cannot accept, or one from upstream) leaves through the stage's down side.
    (NCCL passes no error in band: its up side is a plain NCCLTransport.)"""

    onward: P2PTransport | None = None

    def poison(self, message: str) -> None:
        if self.onward is not None:
            self.onward.poison(message)


def _side(
    backend: str, stage: int, ranks: list[int], groups: Any, device: torch.device,
    timeout: float, control: Any, up: bool,
) -> P2PTransport:
    """One side of a boundary crossing processes (``groups``: its gloo group, or its NCCL
    channel groups)."""
    if backend == "nccl":
        return NCCLTransport(stage, ranks, groups, control, device, timeout)
    cls = _GlooUpSide if up else GlooTransport
    return cls(stage, ranks, groups, device, timeout)


class VirtualStageTransport:
    """One virtual stage's transport: the up side (boundary s-1) and the down side (boundary
    s), each a P2PTransport on that boundary's process group; the methods the runtime calls
    go to the side that carries the channel in that direction (module docstring)."""

    blocking = True

    def __init__(
        self,
        backend: str,
        stage: int,
        ranks: list[int],
        groups: list[Any],
        device: torch.device,
        timeout: float,
        control: Any = None,
    ) -> None:
        V = len(ranks)
        self.stage = stage
        self.ranks = list(ranks)
        self.down: Any = None
        self.up: Any = None
        if stage < V - 1:  # a boundary within this rank is a LocalLink (transport/local_link.py)
            below = groups[stage]
            self.down = (
                below.down if isinstance(below, LocalLink)
                else _side(backend, stage, ranks, below, device, timeout, control, up=False)
            )
        if stage > 0:
            above = groups[stage - 1]
            self.up = (
                above.up if isinstance(above, LocalLink)
                else _side(backend, stage, ranks, above, device, timeout, control, up=True)
            )
            if hasattr(self.up, "onward"):
                self.up.onward = self.down
        self.sides = [t for t in (self.up, self.down) if t is not None]
        main = self.sides[0]
        self.backend, self.device, self.timeout = main.backend, main.device, main.timeout

    def _side(self, channel: str, direction: str) -> P2PTransport:
        side = self.down if (channel == "act") == (direction == "send") else self.up
        if side is None:
            raise ValueError(f"virtual stage {self.stage} has no {channel} channel to {direction} on")
        return side

    # the runtime's calls, routed
    def send(self, channel: str, stage: int, mb: int, value: Any, flag: Any = None) -> None:
        self._side(channel, "send").send(channel, stage, mb, value, flag)

    def recv(self, channel: str, stage: int, mb: int, certain: int | None = None) -> Any:
        return self._side(channel, "recv").recv(channel, stage, mb, certain)

    def release(self, channel: str, mbs: list[int]) -> None:
        self._side(channel, "send").release(channel, mbs)

    def send_meta(self, channel: str, tree: Any | None) -> None:
        self._side(channel, "send").send_meta(channel, tree)

    def recv_meta(self, channel: str) -> Any:
        return self._side(channel, "recv").recv_meta(channel)

    def poison(self, message: str) -> None:
        if self.down is not None:
            self.down.poison(message)

    def unsupported(self, tree: Any) -> str:
        return (self.down or self.sides[0]).unsupported(tree)  # (the side the output leaves by)

    def wait(self, work: Any, what: str, peer: int | None = None) -> None:
        self.sides[0].wait(work, what, peer)

    def wait_host(self, work: Any, what: str, peer: int | None = None) -> None:
        side = self.sides[0]
        getattr(side, "wait_host", side.wait)(work, what, peer)

    def who(self, stage: int) -> str:
        return self.sides[0].who(stage)

    def wait_sends(self) -> None:
        for side in self.sides:
            side.wait_sends()

    def close(self) -> None:
        for side in self.sides:
            side.close()

    @property
    def accept(self) -> Any:
        return None if self.up is None else self.up.accept

    @accept.setter
    def accept(self, check: Any) -> None:
        if self.up is not None:  # the side that receives activations checks their shapes
            self.up.accept = check

    @property
    def shape_changes(self) -> int:
        return 0 if self.down is None else self.down.shape_changes

    def held(self) -> int:
        """Works and bookkeeping both sides still hold (0 after a synchronous step)."""
        return sum(t.held() for t in self.sides)  # a LocalEnd or a P2PTransport


def virtual_transports(
    backend: str,
    layout: Layout,
    V: int,
    device: torch.device,
    timeout: float,
    placement: RankPlacement | None = None,
) -> dict[int, VirtualStageTransport]:
    """The transports of this rank's virtual stages, and one process group per boundary and
    replica (``new_group`` is collective over the world: every rank creates every group, in
    the same order, and keeps its replica's). A boundary whose two stages this rank holds
    (the V's bottom) gets no group but a :class:`LocalLink`. ``placement``: which rank holds
    which stage (default round-robin, stage s on rank s % R)."""
    R = layout.stages
    place = placement or RankPlacement(tuple(s % R for s in range(V)), R)
    nccl = backend == "nccl"
    groups: list[Any] = []
    for d in range(layout.replicas):
        of = [d * R + place.rank_of(s) for s in range(V)]  # global rank of each stage in replica d
        made: list[Any] = []
        for b in range(V - 1):
            pair = sorted({of[b], of[b + 1]})
            if place.same_rank(b):
                made.append(None)
            elif nccl:  # one group per channel direction (transport/nccl.py)
                made.append({(c, b): new_group(pair, timeout=timeout) for c in ("act", "grad")})
            else:
                made.append(new_group(pair, timeout=timeout))
        if d == layout.replica:
            groups = made
    ranks = [layout.pipeline_ranks[place.rank_of(s)] for s in range(V)]
    groups = [
        LocalLink(b, ranks, device, timeout, backend) if g is None else g
        for b, g in enumerate(groups)
    ]
    control = GroupCalls(layout.control_group) if nccl else None
    tps = {
        s: VirtualStageTransport(backend, s, ranks, groups, device, timeout, control)
        for s in place.held(layout.stage)
    }
    # shared-memory rings per boundary (transport/shm.py): each setup is collective over the
    # boundary's two ranks, so every rank sets its boundaries up in increasing order -- the
    # lowest boundary not yet set up then always has both its ranks at it (no deadlock)
    sides = {(s if t is tp.down else s - 1): t for s, tp in tps.items() for t in tp.sides}
    for b in sorted(sides):
        if isinstance(sides[b], GlooTransport):  # (a LocalLink stays in-process; NCCL: no rings)
            sides[b].use_shared_memory([ranks[b + 1] if ranks[b] == layout.rank else ranks[b]])
    return tps


class VirtualRankRuntime(RankRuntime):
    """The rank-level runtime (loss message, agreement) of a rank holding several virtual
    stages, with one :class:`RankRuntime` per virtual stage for its handshake and its shape
    checks (each sees the pipeline as V stages: its ``layout`` is the virtual one)."""

    def __init__(
        self, layout: Layout, transports: dict[int, VirtualStageTransport], timeout: float,
        first_index: int = 0, chunks: int = 1,
    ) -> None:
        super().__init__(
            layout, transports[min(transports)], timeout, first_index, chunks  # type: ignore[arg-type]
        )
        self.transports = transports
        V = len(next(iter(transports.values())).ranks)
        self.per_stage = {
            s: RankRuntime(
                dataclasses.replace(
                    layout, stage=s, stages=V, pipeline_ranks=tuple(tp.ranks), last_index=-1
                ),
                tp,  # type: ignore[arg-type]
                timeout,
            )
            for s, tp in transports.items()
        }
        #: the rank's stages (set once built): (stage, module, loss_fn)
        self.stages: list[tuple[int, nn.Module, Any]] = []

    def handshake(self, module: nn.Module, x0: Any, target0: Any, loss_fn: Any) -> None:
        """Every stage of the rank in increasing order (the chain of Signatures runs through
        the ranks v times), then one agreement for the rank."""
        found = [
            self.per_stage[s].exchange_signatures(m, x0, target0, fn) for s, m, fn in self.stages
        ]
        self.agree_handshake([problem for problem, _ in found])
        for (s, m, _), (_, inp) in zip(self.stages, found, strict=True):
            self.per_stage[s].accept_shapes(m, inp)

    def check_inputs(self, module: nn.Module, xs: list[Any], base: int) -> None:
        try:
            self.per_stage[0].check_inputs(module, xs, base)
        except PipelineInputError:
            self.pass_error(0, base)
            raise

    def pass_error(self, stage: int, mb: int) -> None:
        """An error that stops a step before it starts goes down the virtual stages in place
        of the step's first activation, so it comes back through this rank's later stages:
        each receives it there and passes it on, leaving no message in flight (the group
        stays usable) and no sender waiting for a receive. Under NCCL the error travels on
        the control plane (the shape notice) instead; only the boxes of this rank's own
        boundaries (LocalLink) are cleared of it, so no later step finds it there."""
        if self.nccl:
            for tp in self.transports.values():
                for side in tp.sides:
                    link = getattr(side, "link", None)
                    if link is not None:
                        link.error = None
            return
        for s in sorted(self.transports):
            if s > stage:
                try:
                    self.transports[s].recv("act", s, mb)
                except PipelineInputError:
                    continue
