"""Shared-memory point-to-point messages between neighbouring ranks on one host (gloo pipelines).

Why: on one host, a gloo message pays for the TCP loopback stack twice (the sender's write
syscall runs the receiver's network path, ~50 us of CPU for 16 KiB), a wake-up of the
receiver's gloo loop thread, and then of the receiving thread -- and gloo's rendezvous
protocol holds the payload back until the receiver's "ready" notice returns. A pipeline's
steps are chains of such hops, so on a machine whose ranks share cores the hop latency *is*
the step time (bench/README.md, "Shared memory"). Here a message is one copy into a ring in
shared memory and one futex wake of the thread that waits for it.

What it is: one ring per direction of each neighbour pair -- with virtual stages, of each
boundary between two ranks (virtual.py) -- in ``/dev/shm``, unlinked once both ends have
mapped it, so nothing is left behind by a crash. The sender appends a record
(kind, tag, size, payload) and wakes the receiver; the receiver matches records to its
receives in posting order per (peer, tag), as gloo does, keeps a record that arrives before
its receive, and accepts a message shorter than the posted buffer (gloo does too: the
transport's fills rely on it, framing.py). :class:`SharedMemoryCalls` has the interface of
:class:`~engine.runtime.ranks.transport.groups.GroupCalls` and stands in for it in
:class:`~engine.runtime.ranks.transport.p2p.P2PTransport` (whose rank also sends its loss
and verdict messages through it); the handshake and the collectives stay on gloo, which
also carries:

* a message the ring has no room for: a small *redirect* record takes its place in the
  ring, and the payload travels through gloo on its own tag, which the receiver posts when
  it reaches the record. So a send never blocks on a full ring and never needs the receiver
  to be waiting (gloo's own loop thread moves large payloads in the background), and a
  message larger than the ring simply goes through gloo;
* every pair that cannot share memory (another host or container, a different PID
  namespace, no ``/dev/shm`` room, not Linux on x86-64): decided at setup from what
  both ends could open, so both ends always agree.

A peer that dies is noticed within :data:`LIVENESS_S` (its process is gone or a zombie),
raised as a broken connection; a peer that is alive but silent raises after the
transport's timeout, as gloo does. ``ENGINE_SHM=0`` keeps every message on gloo;
``ENGINE_SHM_RING_KB`` sets the ring size (default 4096 KiB per direction and pair).
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import platform
import secrets
import struct
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SharedMemoryCalls", "SharedMemorySetup", "Ring", "attach", "enabled"]

#: seconds between checks that a silent peer's process still exists
LIVENESS_S = 0.1
#: record kinds
DATA, REDIRECT, WRAP = 1, 2, 3
#: gloo tag offset of a redirected message's payload (the engine's own tags are below 100)
REDIRECT_TAG = 1000
_REC = struct.Struct("<iiq")  # kind, tag, payload bytes
_HDR = 128  # ring header: head u64 @0, tail u64 @8, seq u32 @16, pid u32 @20, start u64 @24, token @32
#: bytes kept free in a ring for redirect records (a data record may not use them)
RESERVE = 64 * 1024
#: seconds a send waits for room for even a redirect record before it raises
FULL_WAIT_S = 60.0
#: x86-64 only: its stores become visible in program order (TSO), which the ring relies on
#: (a payload before the head that publishes it); weaker memory models keep gloo
_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC: Any = _libc() if _FUTEX is not None and os.name == "posix" else None


def enabled() -> bool:
    """Whether this process may use shared memory at all (Linux futexes, ``/dev/shm``,
    ``ENGINE_SHM`` not 0)."""
    return (
        os.environ.get("ENGINE_SHM", "1").strip() != "0"
        and _LIBC is not None
        and platform.system() == "Linux"
        and os.path.isdir("/dev/shm")
    )


def _ring_bytes() -> int:
    raw = os.environ.get("ENGINE_SHM_RING_KB", "4096").strip()
    if not raw.isdigit() or int(raw) < 128:
        raise ValueError(
            f"ENGINE_SHM_RING_KB={raw!r}: give the ring size per direction in KiB, at least 128 "
            "(or ENGINE_SHM=0 for no shared memory)"
        )
    return int(raw) * 1024


def _start_time(pid: int) -> int | None:
    """The kernel's start time of process ``pid`` (None: no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _record_bytes(kind: int, nbytes: int) -> int:
    """Ring bytes of one record: its header, and a data record's payload rounded up to 16."""
    return _REC.size + (-(-nbytes // 16) * 16 if kind == DATA else 0)


class Ring:
    """One direction of a pair: a byte ring in a shared mapping with a futex word.

    Single producer, single consumer. The producer writes the record, then moves ``head``,
    then bumps ``seq`` and wakes; the consumer reads ``seq`` before it looks for records and
    sleeps on it, so a record published after that look changes ``seq`` and the sleep
    returns (the kernel compares under the futex's lock)."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, _HDR + size)  # ENOSPC here, not SIGBUS later
            self.size = os.fstat(fd).st_size - _HDR
            if self.size < 1024 or self.size % 16:
                raise OSError(f"{path}: not a ring ({self.size} bytes)")
            self.mm = mmap.mmap(fd, _HDR + self.size)
        except BaseException:
            if create:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        self._head = ctypes.c_uint64.from_buffer(self.mm, 0)
        self._tail = ctypes.c_uint64.from_buffer(self.mm, 8)
        self._seq = ctypes.c_uint32.from_buffer(self.mm, 16)
        self._seq_addr = ctypes.addressof(self._seq)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        if create:
            self.mm[32:48] = secrets.token_bytes(16)
            struct.pack_into("<IQ", self.mm, 20, os.getpid(), _start_time(os.getpid()) or 0)

    @property
    def token(self) -> bytes:
        return bytes(self.mm[32:48])

    def owner(self) -> tuple[int, int]:
        """The (pid, kernel start time) of the process that created the ring: its writer."""
        pid, start = struct.unpack_from("<IQ", self.mm, 20)
        return pid, start

    def owner_alive(self) -> bool:
        """Whether the ring's writer still runs (same PID and start time: not a reused PID;
        False when this process cannot see it, e.g. another PID namespace)."""
        pid, start = self.owner()
        return start != 0 and _start_time(pid) == start

    # ------------------------------------------------------------------ producer

    def put(self, kind: int, tag: int, payload: Tensor | None, nbytes: int, reserve: int) -> bool:
        """Append one record if it fits with ``reserve`` bytes to spare; False if not."""
        need = _record_bytes(kind, nbytes)
        head = self._head.value
        off = head % self.size
        wrap = self.size - off if off + need > self.size else 0
        if self.size - (head - self._tail.value) < wrap + need + reserve:
            return False
        if wrap:
            _REC.pack_into(self.mm, _HDR + off, WRAP, 0, 0)
            head += wrap
            off = 0
        _REC.pack_into(self.mm, _HDR + off, kind, tag, nbytes)
        if kind == DATA and nbytes:
            start = _HDR + off + _REC.size
            self.bytes[start:start + nbytes].copy_(payload)
        self._head.value = head + need
        self._seq.value = (self._seq.value + 1) & 0xFFFFFFFF
        _LIBC.syscall(_FUTEX, ctypes.c_void_p(self._seq_addr), _FUTEX_WAKE, 1, None, None, 0)
        return True

    # ------------------------------------------------------------------ consumer

    def seq(self) -> int:
        return self._seq.value

    def peek(self) -> tuple[int, int, int, int] | None:
        """The next record: (kind, tag, payload bytes, payload offset), or None."""
        while True:
            tail = self._tail.value
            if tail == self._head.value:
                return None
            off = tail % self.size
            kind, tag, nbytes = _REC.unpack_from(self.mm, _HDR + off)
            if kind == WRAP:
                self._tail.value = tail + (self.size - off)
                continue
            return kind, tag, nbytes, _HDR + off + _REC.size

    def pop(self, kind: int, nbytes: int) -> None:
        self._tail.value = self._tail.value + _record_bytes(kind, nbytes)

    def sleep(self, seq: int, seconds: float) -> None:
        """Until the producer publishes after ``seq`` was read, at most ``seconds``."""
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        _LIBC.syscall(
            _FUTEX, ctypes.c_void_p(self._seq_addr), _FUTEX_WAIT, ctypes.c_uint32(seq), ctypes.byref(ts), None, 0
        )


def _as_bytes(t: Tensor) -> Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class _Sent:
    """A send the ring took: complete (the payload is in shared memory)."""

    __slots__ = ()

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_SENT = _Sent()


class _Received:
    """A receive: matched to a ring record (copied), or to a redirected gloo receive."""

    __slots__ = ("calls", "buf", "src", "tag", "done", "inner", "error")

    def __init__(self, calls: SharedMemoryCalls, buf: Tensor, src: int, tag: int) -> None:
        self.calls, self.buf, self.src, self.tag = calls, buf, src, tag
        self.done = False
        self.inner: Any = None  # the gloo receive of a redirected payload
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done and (self.inner is None or self.inner.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        end = None if seconds is None else time.monotonic() + seconds
        if not self.done:
            self.calls._until_matched(self, end, seconds)
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.inner is not None:
            if end is None:
                return self.inner.wait()
            return self.inner.wait(datetime.timedelta(seconds=max(0.0, end - time.monotonic())))
        return True


class SharedMemoryCalls:
    """``send(t, peer, tag)`` / ``recv(buf, src, tag)`` returning works with ``wait(timeout)``:
    through a ring with each peer in ``rings`` (global rank -> (outgoing, incoming)), through
    ``gloo`` (a :class:`~engine.runtime.ranks.transport.groups.GroupCalls`) with the others
    and for what does not fit (module docstring)."""

    def __init__(self, gloo: Any, rings: dict[int, tuple[Ring, Ring]]) -> None:
        self.gloo = gloo
        self.rings = rings
        #: (src, tag) -> receives posted and not yet matched, in posting order
        self._waiting: dict[tuple[int, int], list[_Received]] = {}
        #: (src, tag) -> records that arrived before their receive: a payload copy, or
        #: None for a redirect
        self._early: dict[tuple[int, int], list[Tensor | None]] = {}
        self._forgotten = False
        #: sends that went through gloo for want of room in the ring (a statistic)
        self.redirected = 0

    def peers(self) -> list[int]:
        return sorted(self.rings)

    def send(self, t: Tensor, peer: int, tag: int) -> Any:
        self._check()
        pair = self.rings.get(peer)
        if pair is None or t.device.type != "cpu":
            return self.gloo.send(t, peer, tag)
        out = pair[0]
        data = _as_bytes(t)
        if out.put(DATA, tag, data, data.numel(), RESERVE):
            return _SENT
        deadline = time.monotonic() + FULL_WAIT_S
        while not out.put(REDIRECT, tag, None, data.numel(), 0):
            # the reserve is full too: 4096 records unread, which no schedule leaves (a peer
            # that stopped reading for good is an error after FULL_WAIT_S)
            if time.monotonic() > deadline or not pair[1].owner_alive():
                raise RuntimeError(
                    f"the shared-memory ring to rank {peer} stayed full for {FULL_WAIT_S:g}s: "
                    "the peer stopped reading (or exited)"
                )
            time.sleep(0.001)
        self.redirected += 1
        return self.gloo.send(t, peer, REDIRECT_TAG + tag)

    def recv(self, buf: Tensor, src: int, tag: int) -> Any:
        self._check()
        if src not in self.rings or buf.device.type != "cpu":
            return self.gloo.recv(buf, src, tag)
        work = _Received(self, buf, src, tag)
        early = self._early.get((src, tag))
        if early:
            self._complete(work, early.pop(0))
        else:
            self._waiting.setdefault((src, tag), []).append(work)
        return work

    def forget(self) -> None:
        self.gloo.forget()
        self.rings = {}
        self._waiting.clear()
        self._early.clear()
        self._forgotten = True

    # ------------------------------------------------------------------ receiving

    def _check(self) -> None:
        if self._forgotten:
            raise RuntimeError("this transport's process group was released at exit")

    def _complete(self, work: _Received, payload: Tensor | None) -> None:
        """``payload``: the record's bytes; None: a redirect (post the gloo receive)."""
        work.done = True
        if payload is None:
            work.inner = self.gloo.recv(work.buf, work.src, REDIRECT_TAG + work.tag)
            return
        room = work.buf.numel() * work.buf.element_size()
        if payload.numel() > room:
            work.error = (
                f"a {payload.numel()}-byte message from rank {work.src} (tag {work.tag}) for a "
                f"{room}-byte receive: the two ranks disagree on the message sizes"
            )
            return
        if work.buf.is_contiguous():
            _as_bytes(work.buf)[: payload.numel()].copy_(payload)
        else:  # (a receive into a strided view: through a contiguous copy)
            tmp = work.buf.contiguous()
            _as_bytes(tmp)[: payload.numel()].copy_(payload)
            work.buf.copy_(tmp)

    def _drain(self, src: int) -> None:
        """Every record ``src`` published so far, matched or kept."""
        ring = self.rings[src][1]
        while True:
            rec = ring.peek()
            if rec is None:
                return
            kind, tag, nbytes, at = rec
            waiting = self._waiting.get((src, tag))
            payload = ring.bytes[at:at + nbytes] if kind == DATA else None
            if waiting:
                self._complete(waiting.pop(0), payload)
            else:
                kept = payload.clone() if payload is not None else None
                self._early.setdefault((src, tag), []).append(kept)
            ring.pop(kind, nbytes)

    def _until_matched(self, work: _Received, end: float | None, seconds: float | None) -> None:
        ring = self.rings[work.src][1]
        checked = time.monotonic()
        while True:
            seq = ring.seq()
            self._drain(work.src)
            if work.done:
                return
            now = time.monotonic()
            if end is not None and now >= end:
                raise RuntimeError(
                    f"Timed out waiting {seconds:g}s for a message from rank {work.src} "
                    "(shared memory)"
                )
            if now - checked >= LIVENESS_S:
                if not ring.owner_alive():
                    raise RuntimeError(
                        f"Connection closed by peer: rank {work.src} (pid {ring.owner()[0]}) "
                        "exited (shared memory)"
                    )
                checked = now
            ring.sleep(seq, LIVENESS_S if end is None else max(1e-4, min(LIVENESS_S, end - now)))


def attach(
    calls: Any, group: Any, me: int, neighbours: list[int], usable: bool = True
) -> SharedMemoryCalls | None:
    """Set up rings with the ``neighbours`` (global ranks) that share this host's memory;
    collective over ``group`` (every rank of it calls, with its own neighbours, also one
    that cannot use rings: ``usable`` False). Returns the calls to use in place of ``calls``
    (a GroupCalls), or None when no pair can share memory. Never raises for a machine that
    cannot share memory (those pairs stay on gloo); a bad ``ENGINE_SHM_RING_KB`` raises here
    after the collective calls, so the other ranks go on instead of waiting."""
    made: dict[int, Ring] = {}
    ok_here = usable and enabled()
    bad: ValueError | None = None
    if ok_here:
        try:
            size = _ring_bytes()
        except ValueError as exc:
            bad, ok_here = exc, False
    if ok_here:
        try:
            tag = secrets.token_hex(8)
            for peer in neighbours:
                made[peer] = Ring(f"/dev/shm/engine-p2p-{tag}-{me}-{peer}", size, create=True)
        except OSError:  # no room in /dev/shm, no permission: gloo
            for ring in made.values():
                _unlink(ring.path)
            made, ok_here = {}, False
    offer = {peer: (r.path, r.token) for peer, r in made.items()} if ok_here else {}
    offers: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(offers, (me, offer), group=group)
    opened: dict[int, Ring] = {}
    for src, theirs in offers:
        if src == me or me not in theirs or src not in made:
            continue
        path, token = theirs[me]
        try:
            ring = Ring(path, 0, create=False)
        except (OSError, ValueError):
            continue
        if ring.token == token and ring.owner_alive():  # the same memory, and PIDs we can see
            opened[src] = ring
    answers: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, (me, sorted(opened)), group=group)
    for ring in made.values():  # every end that could map it has: nothing stays on disk
        _unlink(ring.path)
    if bad is not None:
        raise bad
    took = {r: set(got) for r, got in answers}
    rings = {
        peer: (made[peer], opened[peer])
        for peer in neighbours
        if peer in opened and me in took.get(peer, set())
    }
    return SharedMemoryCalls(calls, rings) if rings else None


class SharedMemorySetup:
    """Mixin of :class:`~engine.runtime.ranks.transport.p2p.P2PTransport`: its gloo messages
    with the neighbouring stages through shared memory where they share this host."""

    backend: str
    device: torch.device
    group: Any
    ranks: list[int]
    stage: int
    _gloo: Any

    @property
    def calls(self) -> Any:
        """This transport's point-to-point calls on its group: a GroupCalls, or the
        SharedMemoryCalls in front of it (the rank's loss and verdict messages use them too,
        so both ends of a pair always take the same path)."""
        return self._gloo

    def use_shared_memory(self, neighbours: list[int] | None = None) -> bool:
        """Collective over this transport's group (every rank of it calls once, after
        building its transport). ``neighbours``: the global ranks it exchanges messages with
        (default: the stages before and after). True when at least one of them now goes
        through a ring."""
        if self.backend != "gloo":  # (the same on every rank of a pipeline)
            return False
        near = neighbours if neighbours is not None else [
            self.ranks[s] for s in (self.stage - 1, self.stage + 1) if 0 <= s < len(self.ranks)
        ]
        # a rank whose tensors live on a GPU joins the setup too (its peers wait for it)
        calls = attach(self._gloo, self.group, self.ranks[self.stage], near, self.device.type == "cpu")
        if calls is not None:
            self._gloo = calls
        return calls is not None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
