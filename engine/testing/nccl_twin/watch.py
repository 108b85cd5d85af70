"""Deadlock detection across the job: the flight recorder NCCL users ask for.

A rank whose wait has lasted a poll interval publishes its state in the job's store (blocked
or not, a count of its progress, its queue heads). A blocked rank reads the states of every
rank it shares a twin group with, and of theirs in turn (so a rank that could still unblock
the others counts); when all of them are blocked and no count changed for the limit, the
first to see it writes one verdict, and every rank listed in it raises it from its wait. A
rank accepts a verdict only if it has not progressed since, so a verdict written from a stale
snapshot cannot stop a rank that was not stuck. Waits shorter than a poll interval never touch
the store.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import torch.distributed as dist

State = dict[str, Any]

ADVICE = (
    "NCCL runs each communicator's ops strictly in posting order, and a send completes only "
    "when the receiver's matching receive is running (no eager buffer). Ops that must "
    "progress together belong in one dist.batch_isend_irecv list; ops that must not wait for "
    "each other belong on different communicators (process groups)."
)


def report(states: dict[int, State], limit: float) -> str:
    lines = [
        f"NCCL twin: deadlock: no op progressed anywhere in the job for {limit:g} s while every "
        f"rank waited. Each rank's queue heads, one per communicator with pending entries "
        f"(entry #k: the k-th op posted on that communicator by that rank; send/recv #k: the "
        f"k-th between those two ranks there, by which the two ends match; collective #k: the "
        f"k-th collective there):"
    ]
    for r in sorted(states):
        s = states[r]
        lines.append(f"  rank {r}: waiting on {'; '.join(s['waiting']) or 'nothing'}")
        lines += [f"    {h}" for h in s["heads"]] or ["    (no pending entries)"]
    lines.append(ADVICE)
    return "\n".join(lines)


class Watch:
    """This rank's view of the job's blocked ranks (one store prefix per hub generation)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, limit: float) -> None:
        self.store, self.prefix, self.rank, self.limit = store, prefix, rank, limit
        self.lock = threading.Lock()
        self.published: State | None = None
        self.verdicts = 0  # the index of the next verdict to look for
        self.seen: tuple[tuple[int, int], ...] | None = None
        self.since = 0.0
        self.publish({"blocked": False, "progress": 0, "heads": [], "waiting": [], "peers": []})

    def key(self, what: str) -> str:
        return f"{self.prefix}{what}"

    def publish(self, state: State) -> None:
        if state != self.published:
            self.store.set(self.key(f"state/{self.rank}"), pickle.dumps(state))
            self.published = state

    def unblock(self, state: State) -> None:
        """Called when the last wait of this rank ends: say so if it had said it was blocked."""
        if self.published is not None and self.published["blocked"]:
            with self.lock:
                self.publish(state)

    def poll(self, mine: State, gone: set[int]) -> str | None:
        """One look, from a blocked wait: the verdict text if the job is deadlocked and this
        rank is part of it, else None."""
        with self.lock:
            self.publish(mine)
            text = self._verdict(mine)
            if text is not None:
                return text
            states = self._closure(mine, gone)
            if states is None or not all(s["blocked"] for s in states.values()):
                self.seen = None
                return None
            snap = tuple(sorted((r, int(s["progress"])) for r, s in states.items()))
            now = time.monotonic()
            if snap != self.seen:
                self.seen, self.since = snap, now
                return None
            if now - self.since < self.limit:
                return None
            n = self.verdicts
            if self.store.add(self.key(f"elect/{n}"), 1) == 1:
                verdict = {"progress": dict(snap), "text": report(states, self.limit)}
                self.store.set(self.key(f"verdict/{n}"), pickle.dumps(verdict))
            return self._verdict(mine)

    def _verdict(self, mine: State) -> str | None:
        while self.store.check([self.key(f"verdict/{self.verdicts}")]):
            verdict = pickle.loads(self.store.get(self.key(f"verdict/{self.verdicts}")))
            self.verdicts += 1
            if verdict["progress"].get(self.rank) == mine["progress"]:
                return str(verdict["text"])
        return None

    def _closure(self, mine: State, gone: set[int]) -> dict[int, State] | None:
        """The states of the live ranks reachable through shared groups, or None while one of
        them has not published (it may still post what unblocks the others)."""
        states: dict[int, State] = {self.rank: mine}
        todo = [r for r in mine["peers"] if r != self.rank]
        while todo:
            r = todo.pop()
            if r in states or r in gone:
                continue
            key = self.key(f"state/{r}")
            if not self.store.check([key]):
                return None
            s = pickle.loads(self.store.get(key))
            if s.get("left"):
                continue
            states[r] = s
            todo += [p for p in s["peers"] if p not in states]
        return states
