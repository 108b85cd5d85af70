"""The twin's per-process state: every communicator's queue, the matching of point-to-point
ops and collectives across ranks, and the failures NCCL can raise.

One :class:`Hub` per process stands for NCCL plus the GPU: ops are posted to it under its lock,
frames from peers arrive on the wire's reader threads, and a watchdog thread enforces the
groups' timeouts, so ops progress whether or not anyone waits on them. Rules enforced here:

* an entry (one op, one ``batch_isend_irecv`` list, one collective) starts only when every
  earlier entry of its communicator on this rank completed;
* point-to-point ops match by posting order per (communicator, sender, receiver), tags ignored;
  when a send's entry starts it ships its bytes, when a receive's entry starts it sends a
  clear-to-send; a send completes on the clear-to-send (its receive is running), a receive on
  the bytes (its send is running): no op completes before both ends run;
* a collective completes when every member's frame for it arrived (every member runs it);
* sizes, dtypes and collectives must agree; a disagreement, a timeout, or a peer that left
  aborts the communicator on this rank, failing every entry queued on it.

Frames to peers are queued under the lock and sent after it is released; works are settled
after it too (their futures run callbacks).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from engine.testing.nccl_twin import wire as W
from engine.testing.nccl_twin.dtypes import as_bytes
from engine.testing.nccl_twin.entries import (
    P2P,
    Coll,
    Comm,
    Entry,
    GroupInfo,
    Handle,
    meta,
    meta_text,
)
from engine.testing.nccl_twin.errors import (
    DeadlockError,
    MismatchError,
    PeerLeftError,
    TwinError,
    TwinTimeoutError,
)
from engine.testing.nccl_twin.watch import Watch
from engine.testing.nccl_twin.work import TwinWork

T = TypeVar("T")
#: (kind, tensor as NCCL moves it, tensor as given, peer's group rank)
Spec = tuple[str, torch.Tensor, torch.Tensor, int]


class Hub:
    def __init__(self, store: dist.Store, rank: int, gen: int, limit: float) -> None:
        self.rank, self.gen, self.limit = rank, gen, limit
        self.lock = threading.Lock()
        self.comms: dict[str, Comm] = {}
        self.groups: dict[str, GroupInfo] = {}
        self.gone: dict[int, str] = {}  # rank -> why it left the job
        self.left: dict[tuple[str, int], str] = {}  # (group, rank) -> why it left the group
        self.progress = 0  # entries posted plus entries finished: the deadlock watch's clock
        self.waiting: dict[object, Entry] = {}
        self.outbox: dict[int, list[bytes]] = defaultdict(list)
        self.dirty: set[int] = set()
        self.settled: list[Handle] = []
        self.closed = False
        self.poll_s = min(0.5, max(0.05, limit / 5))
        prefix = f"nccl_twin/{gen}/"
        self.watch = Watch(store, prefix, rank, limit)
        self.wire = W.Wire(
            self,
            rank,
            publish=lambda addr: store.set(f"{prefix}addr/{rank}", addr),
            lookup=lambda peer: store.get(f"{prefix}addr/{peer}").decode(),
            gen=gen,
        )
        threading.Thread(target=self._watchdog, name="nccl-twin-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ the lock's discipline

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` under the lock; then send what it queued and settle what it finished."""
        with self.lock:
            result = fn(*args)
            settled, self.settled = self.settled, []
            dirty, self.dirty = self.dirty, set()
        for work in settled:
            work.settle()
        for peer in sorted(dirty):
            self.wire.flush(peer, self._take)
        return result

    def _take(self, peer: int) -> list[bytes]:
        with self.lock:
            return self.outbox.pop(peer, [])

    def _emit(self, peer: int, header: tuple[Any, ...], payload: bytes = b"") -> None:
        if peer == self.rank:  # stored only: the entry being started reads it next
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else (
                torch.empty(0, dtype=torch.uint8)
            )
            self._store(peer, header, data)
        else:
            self.outbox[peer].append(W.frame(header, payload))
            self.dirty.add(peer)

    # ------------------------------------------------------------------ groups and posting

    def register_group(self, name: str, ranks: tuple[int, ...], timeout: float) -> GroupInfo:
        info = GroupInfo(name, ranks, ranks.index(self.rank), timeout)
        with self.lock:
            self.groups[name] = info
        return info

    def _comm(self, key: str) -> Comm:
        comm = self.comms.get(key)
        if comm is None:
            comm = self.comms[key] = Comm(key)
        return comm

    def _group_comm(self, g: GroupInfo) -> Comm:
        comm = self._comm(g.name)
        if comm.group is None:
            comm.bind(g, g.ranks, f"communicator of {g.title}")
        return comm

    def _pair_comm(self, g: GroupInfo, peer: int) -> Comm:
        lo, hi = sorted((g.me, peer))
        comm = self._comm(f"{g.name}/{lo}:{hi}")
        if comm.group is None:
            a, b = g.ranks[lo], g.ranks[hi]
            comm.bind(g, (a, b), f"2-rank communicator {lo}:{hi} of group {g.name!r} "
                                 f"(global ranks {a}, {b}; unbatched ops)")
        return comm

    def post_p2p(self, g: GroupInfo, specs: list[Spec], batched: bool, label: str | None) -> TwinWork:
        return self._run(self._post_p2p, g, specs, batched, label)

    def _post_p2p(self, g: GroupInfo, specs: list[Spec], batched: bool, label: str | None) -> TwinWork:
        for _, _, _, peer in specs:
            if not 0 <= peer < len(g.ranks):
                raise ValueError(f"peer {peer} is not a rank of {g.title}")
        comm = self._group_comm(g) if batched else self._pair_comm(g, specs[0][3])
        ops = []
        for kind, tensor, shown, peer in specs:
            dst = g.ranks[peer]
            counter = comm.sends if kind == "send" else comm.recvs
            ops.append(P2P(kind, tensor, shown, dst, counter[dst]))
            counter[dst] += 1
        return self._enqueue(Entry(comm, comm.numbered, ops, None, label, batched,
                                   time.monotonic() + g.timeout))

    def post_coll(self, g: GroupInfo, coll: Coll, label: str | None) -> TwinWork:
        return self._run(self._post_coll, g, coll, label)

    def _post_coll(self, g: GroupInfo, coll: Coll, label: str | None) -> TwinWork:
        comm = self._group_comm(g)
        coll.seq = comm.colls
        comm.colls += 1
        return self._enqueue(Entry(comm, comm.numbered, [], coll, label, False,
                                   time.monotonic() + g.timeout))

    def _enqueue(self, entry: Entry) -> TwinWork:
        comm = entry.comm
        comm.numbered += 1
        work = entry.work = TwinWork(self, entry)
        self.progress += 1
        assert comm.group is not None
        peers = {op.peer for op in entry.ops} | (set(comm.members) if entry.coll else set())
        peers.discard(self.rank)
        if comm.group.closed:
            self._fail(entry, TwinError(f"NCCL twin: {entry.describe()}: the process group was "
                                        f"{comm.group.closed} on rank {self.rank}"))
        elif comm.error is not None:
            self._fail(entry, type(comm.error)(
                f"{entry.describe()} cannot run: its communicator was aborted on rank "
                f"{self.rank} after: {comm.error}"))
        elif why := self._left_for(comm, peers):
            self._fail(entry, PeerLeftError(f"NCCL twin: {entry.describe()}: {why}"))
        else:
            comm.queue.append(entry)
            self.dirty |= peers - self.wire.connected()  # connect now: a departure shows
            self._pump(comm)
        return work

    def _left_for(self, comm: Comm, peers: set[int]) -> str | None:
        for r in sorted(peers):
            if r in self.gone:
                return f"rank {r} left the job: {self.gone[r]}"
            assert comm.group is not None
            if (comm.group.name, r) in self.left:
                return f"rank {r} left {comm.group.title}: {self.left[(comm.group.name, r)]}"
        return None

    # ------------------------------------------------------------------ running entries

    def _pump(self, comm: Comm) -> None:
        while comm.queue:
            head = comm.queue[0]
            if head.state == "queued":
                head.state = "running"
                self._start(head)
            self._advance(head)
            if not head.finished:
                return
            if comm.queue and comm.queue[0] is head:  # an abort empties the queue itself
                comm.queue.popleft()

    def _start(self, entry: Entry) -> None:
        comm = entry.comm
        for op in entry.ops:
            if op.kind == "send":
                header = ("data", comm.key, op.seq, meta(op.tensor))
                self._emit(op.peer, header, W.pack([op.tensor]))
            else:
                self._emit(op.peer, ("cts", comm.key, op.seq, meta(op.tensor)))
        coll = entry.coll
        if coll is not None:
            for j, member in enumerate(comm.members):
                given = coll.give(j)
                if member == self.rank:
                    coll.own = given
                else:
                    metas = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in given]
                    header = ("coll", comm.key, coll.seq, coll.signature, metas)
                    self._emit(member, header, W.pack(given))

    def _advance(self, entry: Entry) -> None:
        if entry.state != "running":
            return
        comm = entry.comm
        try:
            for op in entry.ops:
                if op.done:
                    continue
                if op.kind == "send":
                    theirs = comm.cts.pop((op.peer, op.seq), None)
                    if theirs is not None:
                        self._agree(entry, op, meta(op.tensor), theirs, self.rank, op.peer)
                        op.done = True
                else:
                    got = comm.data.pop((op.peer, op.seq), None)
                    if got is not None:
                        self._agree(entry, op, got[0], meta(op.tensor), op.peer, self.rank)
                        as_bytes(op.tensor).copy_(got[1])
                        op.done = True
            coll_done = entry.coll is None or self._collect(entry, entry.coll)
        except MismatchError as exc:
            self._abort(comm, exc)
            return
        except Exception as exc:  # a bad output tensor, say: fail the op, not the thread
            self._abort(comm, TwinError(
                f"NCCL twin: {entry.describe()} failed on rank {self.rank}: "
                f"{type(exc).__name__}: {exc}"))
            return
        if coll_done and all(op.done for op in entry.ops):
            entry.state = "done"
            self.progress += 1
            assert entry.work is not None
            self.settled.append(entry.work)

    def _agree(self, entry: Entry, op: P2P, sent: Any, received: Any, src: int, dst: int) -> None:
        if sent[:2] != received[:2]:
            raise MismatchError(
                f"NCCL twin: size/dtype mismatch on {entry.comm.title}, {op.kind} #{op.seq} from "
                f"rank {src} to rank {dst} (matched by posting order; tags are ignored): rank "
                f"{src} sends {meta_text(sent)} ({sent[0]} elements), rank {dst} receives into "
                f"{meta_text(received)} ({received[0]} elements). NCCL would corrupt memory or "
                f"hang. This rank's {entry.describe()}"
            )

    def _collect(self, entry: Entry, coll: Coll) -> bool:
        comm = entry.comm
        got = comm.contrib.get(coll.seq, {})
        if any(m not in got for m in comm.members if m != self.rank):
            return False
        parts = []
        for m in comm.members:
            if m == self.rank:
                parts.append(coll.own)
                continue
            sig, tensors = got[m]
            if sig != coll.signature:
                raise MismatchError(
                    f"NCCL twin: collective mismatch on {comm.title}, collective #{coll.seq}: "
                    f"rank {self.rank} runs {coll.signature}, rank {m} runs {sig}. NCCL would "
                    f"hang or corrupt memory. This rank's {entry.describe()}"
                )
            parts.append(tensors)
        comm.contrib.pop(coll.seq, None)
        try:
            coll.take(parts)
        except MismatchError as exc:
            raise MismatchError(f"NCCL twin: on {comm.title}, collective #{coll.seq}: {exc}") from None
        return True

    def _fail(self, entry: Entry, exc: BaseException) -> None:
        entry.state, entry.error = "failed", exc
        self.progress += 1
        assert entry.work is not None
        self.settled.append(entry.work)

    def _abort(self, comm: Comm, exc: BaseException, first: Entry | None = None) -> None:
        """NCCL aborts a communicator after an error: fail everything queued on it."""
        if comm.error is None:
            comm.error = exc
        queue, comm.queue = list(comm.queue), type(comm.queue)()
        for e in queue:
            if e is (first or queue[0]):
                self._fail(e, exc)
            else:
                self._fail(e, type(exc)(
                    f"{e.describe()} never ran: its communicator was aborted on rank {self.rank} "
                    f"after: {exc}"))

    # ------------------------------------------------------------------ frames and departures

    def on_frame(self, src: int, header: tuple[Any, ...], payload: torch.Tensor) -> None:
        self._run(self._deliver, src, header, payload)

    def _deliver(self, src: int, header: tuple[Any, ...], payload: torch.Tensor) -> None:
        if header[0] == "left":
            self._group_left(src, header[1], header[2])
            return
        comm = self._store(src, header, payload)
        if comm.queue:
            self._advance(comm.queue[0])
            self._pump(comm)

    def _store(self, src: int, header: tuple[Any, ...], payload: torch.Tensor) -> Comm:
        """Keep what ``src`` sent ahead until the matching entry here runs."""
        kind, comm = header[0], self._comm(header[1])
        if kind == "data":
            comm.data[(src, header[2])] = (header[3], payload)
        elif kind == "cts":
            comm.cts[(src, header[2])] = header[3]
        elif kind == "coll":
            comm.contrib.setdefault(header[2], {})[src] = (header[3], W.unpack(payload, header[4]))
        return comm

    def on_gone(self, rank: int, why: str) -> None:
        self._run(self._gone, rank, why)

    def _gone(self, rank: int, why: str) -> None:
        if rank in self.gone or self.closed:
            return
        self.gone[rank] = why
        for comm in list(self.comms.values()):
            self._fail_needing(comm, rank, f"rank {rank} left the job: {why}")

    def _group_left(self, rank: int, group: str, why: str) -> None:
        self.left[(group, rank)] = why
        for comm in list(self.comms.values()):
            if comm.group is not None and comm.group.name == group:
                self._fail_needing(comm, rank, f"rank {rank} {why}")

    def _fail_needing(self, comm: Comm, rank: int, why: str) -> None:
        for e in comm.queue:
            if self._needs(e, rank):
                self._abort(comm, PeerLeftError(
                    f"NCCL twin: {why}, while rank {self.rank}'s {e.describe()} needed it"), e)
                return

    @staticmethod
    def _needs(e: Entry, rank: int) -> bool:
        """Whether ``e`` still needs ``rank``: a collective it has not heard from while running
        (a queued one cannot have let the rank finish), or an unfinished op with it."""
        if e.coll is not None:
            heard = e.state == "running" and rank in e.comm.contrib.get(e.coll.seq, {})
            return rank in e.comm.members and not heard
        return any(not op.done and op.peer == rank for op in e.ops)

    def close_group(self, g: GroupInfo, why: str) -> None:
        """``pg.abort()``/``shutdown()``: fail this rank's pending ops of the group, tell the
        other members (their waits on this rank raise now), and close the hub with its last group."""
        self._run(self._close_group, g, why)
        with self.lock:
            last = all(info.closed for info in self.groups.values())
        if last:
            self.close()

    def _close_group(self, g: GroupInfo, why: str) -> None:
        if g.closed:
            return
        g.closed = why
        for comm in list(self.comms.values()):
            if comm.group is g and comm.queue:
                self._abort(comm, TwinError(
                    f"NCCL twin: {comm.queue[0].describe()}: the process group was {why} on "
                    f"rank {self.rank}"))
        for r in g.ranks:
            if r != self.rank and r not in self.gone:
                self._emit(r, ("left", g.name, f"left {g.title}: it was {why} there"))

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            state = self._state(False) | {"left": True}
        try:
            self.watch.publish(state)
        except Exception:  # the store may be gone at exit; the sockets tell the peers anyway
            pass
        self.wire.close()

    # ------------------------------------------------------------------ timeouts and waits

    def _watchdog(self) -> None:
        while not self.closed:
            time.sleep(0.2)
            self._run(self._expire, time.monotonic())

    def _expire(self, now: float) -> None:
        for comm in list(self.comms.values()):
            for e in comm.queue:
                if now > e.deadline:
                    assert comm.group is not None
                    self._abort(comm, TwinTimeoutError(
                        f"NCCL twin: Watchdog caught collective operation timeout: "
                        f"{e.describe()} on rank {self.rank} timed out after "
                        f"{now - e.posted:.1f} s (the group's timeout is "
                        f"{comm.group.timeout:g} s) in state {e.state}"), e)
                    break

    def wait(self, work: TwinWork, timeout: float | None) -> None:
        entry = work.entry
        until = None if timeout is None else time.monotonic() + timeout
        token = object()
        with self.lock:
            self.waiting[token] = entry
        try:
            while not work.event.is_set():
                left = self.poll_s if until is None else min(self.poll_s, until - time.monotonic())
                if work.event.wait(max(left, 0.0)):
                    break
                if until is not None and time.monotonic() >= until:
                    self._run(self._wait_expired, entry, timeout)
                    continue
                with self.lock:
                    mine, gone = self._state(True), set(self.gone)
                verdict = self.watch.poll(mine, gone)
                if verdict is not None:
                    self._run(self._deadlocked, verdict)
        finally:
            with self.lock:
                del self.waiting[token]
                idle = self._state(False) if not self.waiting else None
            if idle is not None:
                self.watch.unblock(idle)
        if entry.error is not None:
            raise entry.error

    def _wait_expired(self, entry: Entry, timeout: float) -> None:
        if not entry.finished:
            self._abort(entry.comm, TwinTimeoutError(
                f"NCCL twin: wait(timeout={timeout:g} s) timed out: {entry.describe()} had not "
                f"completed on rank {self.rank} (state {entry.state}); like ProcessGroupNCCL "
                f"the twin aborts the communicator"), entry)

    def _deadlocked(self, verdict: str) -> None:
        """Every pending entry of this rank fails with the report (their communicators are
        aborted: NCCL could only be killed here)."""
        for comm in list(self.comms.values()):
            queue, comm.queue = list(comm.queue), type(comm.queue)()
            for e in queue:
                exc = DeadlockError(f"{verdict}\nRaised on rank {self.rank} for its {e.describe()}.")
                comm.error = comm.error or exc
                self._fail(e, exc)

    def _needs_now(self, e: Entry) -> str:
        """What the head entry ``e`` waits for, in words."""
        if e.state != "running":
            return e.state
        if e.coll is not None:
            heard = e.comm.contrib.get(e.coll.seq, {})
            missing = [m for m in e.comm.members if m != self.rank and m not in heard]
            return f"running; waits for ranks {missing} to run it"
        wants = [
            f"rank {op.peer} to run the matching {'recv' if op.kind == 'send' else 'send'}"
            for op in e.ops if not op.done
        ]
        return "running; waits for " + ", ".join(wants)

    def _state(self, blocked: bool) -> dict[str, Any]:
        heads = []
        for comm in self.comms.values():
            if comm.queue:
                head, more = comm.queue[0], len(comm.queue) - 1
                behind = f"; {more} more queued behind it" if more else ""
                heads.append(f"{head.describe()} [{self._needs_now(head)}]{behind}")
        waiting = sorted({e.describe() for e in self.waiting.values()})
        peers = sorted({r for g in self.groups.values() if not g.closed for r in g.ranks})
        return {"blocked": blocked, "progress": self.progress, "heads": heads,
                "waiting": waiting, "peers": peers}
