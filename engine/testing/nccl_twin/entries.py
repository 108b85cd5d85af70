"""What a communicator's in-order queue holds, and the communicator itself.

An *entry* is what NCCL runs as one unit on a communicator's stream: one unbatched op, one
``batch_isend_irecv`` list (an NCCL group: its ops progress together), or one collective. An
entry starts only when every earlier entry of its communicator on this rank completed. A
*communicator* also keeps what its peers sent ahead of this rank (a send's data, a receive's
clear-to-send, a collective's contribution), keyed by sequence numbers, until the matching
entry here runs. Plain records, plus the text that errors and the deadlock report print.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.testing.nccl_twin.dtypes import short


class Handle(Protocol):
    """An entry's work, as the hub sees it (engine.testing.nccl_twin.work.TwinWork)."""

    def settle(self) -> None: ...

#: (numel, dtype name, shape): what the two ends of a point-to-point op must agree on
Meta = tuple[int, str, tuple[int, ...]]


def meta(t: torch.Tensor) -> Meta:
    return (t.numel(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def meta_text(m: Meta) -> str:
    return f"{m[1]}{list(m[2])}"


@dataclass(eq=False)
class GroupInfo:
    """One process group made by the twin backend."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    me: int  # this process's group rank
    timeout: float  # seconds: the watchdog's limit for each work
    closed: str | None = None  # why it takes no more ops (shut down, aborted)

    @property
    def title(self) -> str:
        return f"group {self.name!r} (global ranks {list(self.ranks)})"


@dataclass(eq=False)
class P2P:
    """One point-to-point op of an entry."""

    kind: str  # "send" or "recv"
    tensor: torch.Tensor  # as NCCL moves it (complex: its real view)
    shown: torch.Tensor  # as the caller passed it (for messages)
    peer: int  # global rank
    seq: int  # its index among this communicator's ops from the sender to the receiver
    done: bool = False

    def describe(self) -> str:
        way = "to" if self.kind == "send" else "from"
        return f"{self.kind} {way} rank {self.peer} #{self.seq}, {short(self.shown)}"


@dataclass(eq=False)
class Coll:
    """One collective: what this rank gives each member at its start, and what it does with
    what every member gave it (in group-rank order) at its end."""

    name: str
    signature: tuple[Any, ...]  # what every member must agree on
    give: Callable[[int], list[torch.Tensor]]  # group rank -> tensors sent to it
    take: Callable[[list[list[torch.Tensor]]], None]  # writes the outputs
    outputs: list[torch.Tensor]
    what: str  # "float32[4] SUM"
    seq: int = -1  # its index among the communicator's collectives, set at posting
    own: list[torch.Tensor] = field(default_factory=list)  # what this rank gave itself

    def describe(self) -> str:
        return f"{self.name} #{self.seq}, {self.what}"


@dataclass(eq=False)
class Entry:
    comm: Comm
    number: int  # posting index on its communicator
    ops: list[P2P]
    coll: Coll | None
    label: str | None
    batched: bool
    deadline: float  # time.monotonic() past which the watchdog fails it
    posted: float = field(default_factory=time.monotonic)
    state: str = "queued"  # queued -> running -> done | failed
    error: BaseException | None = None
    work: Handle | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")

    def describe(self) -> str:
        if self.coll is not None:
            body = self.coll.describe()
        elif self.batched:
            body = "batch_isend_irecv [" + "; ".join(
                op.describe() + (" (done)" if op.done else "") for op in self.ops
            ) + "]"
        else:
            body = self.ops[0].describe()
        label = f", label {self.label!r}" if self.label else ""
        return f"entry #{self.number} on the {self.comm.title}: {body}{label}"

    def outputs(self) -> list[torch.Tensor]:
        return self.coll.outputs if self.coll is not None else [op.shown for op in self.ops]


class Comm:
    """One communicator on this rank: its queue, its counters, what peers sent ahead."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.title = key
        self.group: GroupInfo | None = None  # None until this rank posts on it
        self.members: tuple[int, ...] = ()  # global ranks, in communicator-rank order
        self.queue: deque[Entry] = deque()
        self.numbered = 0
        self.sends: Counter[int] = Counter()  # next send seq, by receiver
        self.recvs: Counter[int] = Counter()  # next receive seq, by sender
        self.colls = 0
        self.data: dict[tuple[int, int], tuple[Meta, torch.Tensor]] = {}  # (sender, seq)
        self.cts: dict[tuple[int, int], Meta] = {}  # (receiver, seq): its receive runs
        self.contrib: dict[int, dict[int, tuple[tuple[Any, ...], list[torch.Tensor]]]] = {}
        self.error: BaseException | None = None  # set once: the communicator is aborted

    def bind(self, group: GroupInfo, members: tuple[int, ...], title: str) -> None:
        self.group, self.members, self.title = group, members, title
