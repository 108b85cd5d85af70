"""Bytes between the twin's processes: one TCP connection per ordered pair of ranks.

Why sockets of its own (not the store, not a gloo group): a blocking ``recv`` costs no CPU
while idle, a frame costs one system call each way, and a process that exits closes its
sockets, so its peers learn it left at once (NCCL's remote error) instead of at a timeout.
Each rank listens on 127.0.0.1 (the twin is single-host) and publishes its port in the job's
store; a rank sends on the connection it opened to the peer and reads on the ones its peers
opened to it, one reader thread each, so frames from one peer arrive in the order it sent
them. The reader threads hand frames to the hub; nothing here knows NCCL's rules.
"""

from __future__ import annotations

import ctypes
import pickle
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

_PREFIX = struct.Struct("!IQ")  # header bytes, payload bytes


class Receiver(Protocol):
    def on_frame(self, src: int, header: tuple[Any, ...], payload: torch.Tensor) -> None: ...

    def on_gone(self, rank: int, why: str) -> None: ...


def pack(tensors: list[torch.Tensor]) -> bytes:
    """The bytes of contiguous tensors, back to back (a copy taken now)."""
    out = []
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            out.append(ctypes.string_at(t.data_ptr(), n))
    return b"".join(out)


def unpack(payload: torch.Tensor, metas: list[tuple[str, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Tensors back from :func:`pack`'s bytes (``payload``: uint8) and their (dtype, shape)."""
    out, at = [], 0
    for dtype_name, shape in metas:
        dtype = getattr(torch, dtype_name)
        t = torch.empty(shape, dtype=dtype)
        n = t.numel() * t.element_size()
        if n:
            t.reshape(-1).view(torch.uint8).copy_(payload[at : at + n])
        at += n
        out.append(t)
    return out


def frame(header: tuple[Any, ...], payload: bytes = b"") -> bytes:
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    return _PREFIX.pack(len(head), len(payload)) + head + payload


def _read_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def _read_frame(sock: socket.socket) -> tuple[tuple[Any, ...], torch.Tensor] | None:
    prefix = _read_exact(sock, _PREFIX.size)
    if prefix is None:
        return None
    hlen, plen = _PREFIX.unpack(prefix)
    head = _read_exact(sock, hlen)
    body = _read_exact(sock, plen) if plen else bytearray()
    if head is None or body is None:
        return None
    payload = torch.frombuffer(body, dtype=torch.uint8) if plen else torch.empty(0, dtype=torch.uint8)
    return pickle.loads(head), payload


class Wire:
    """This rank's listener, its connections, and the threads that read them."""

    def __init__(
        self, receiver: Receiver, rank: int, publish: Callable[[str], None],
        lookup: Callable[[int], str], gen: int,
    ) -> None:
        self.receiver, self.rank, self.lookup, self.gen = receiver, rank, lookup, gen
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.mu = threading.Lock()
        self.out: dict[int, socket.socket] = {}  # connections this rank opened, by peer
        self.incoming: dict[int, socket.socket] = {}  # connections peers opened, by peer
        self.send_locks: dict[int, threading.Lock] = {}
        self.closing = False
        threading.Thread(target=self._accept, name="nccl-twin-accept", daemon=True).start()
        publish(f"127.0.0.1:{self.listener.getsockname()[1]}")

    # ------------------------------------------------------------------ sending

    def send_lock(self, peer: int) -> threading.Lock:
        with self.mu:
            return self.send_locks.setdefault(peer, threading.Lock())

    def flush(self, peer: int, take: Callable[[int], list[bytes]]) -> None:
        """Send ``peer`` every frame ``take(peer)`` hands out, in order, until it hands none.
        Whoever queued frames calls this after releasing the hub's lock; the per-peer lock
        keeps one sender at a time, so frames leave in the order they were queued. A peer
        found gone is reported after the per-peer lock is released."""
        with self.send_lock(peer):
            sock, why = self._connected(peer)
            while frames := take(peer):
                try:
                    sock.sendall(b"".join(frames))
                except OSError as exc:
                    why = f"sending to it failed ({exc})"
                    sock = self._dead(peer)
        if why is not None and not self.closing:
            self.receiver.on_gone(peer, why)

    def connected(self) -> set[int]:
        """The peers this rank opened a connection to (or found gone)."""
        with self.mu:
            return set(self.out)

    def _connected(self, peer: int) -> tuple[socket.socket, str | None]:
        """The connection to ``peer`` (opened now if need be), or a dead one and why."""
        with self.mu:
            sock = self.out.get(peer)
        if sock is not None:
            return sock, None
        if self.closing:
            return _Dead(), None  # type: ignore[return-value]
        try:
            host, port = self.lookup(peer).rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(frame(("hello", self.rank, self.gen)))
        except Exception as exc:  # refused, reset, or the store could not say where
            return self._dead(peer), f"connecting to it failed ({type(exc).__name__}: {exc})"
        with self.mu:
            self.out[peer] = sock
        threading.Thread(
            target=self._watch_out, args=(peer, sock), name=f"nccl-twin-out-{peer}", daemon=True
        ).start()
        return sock, None

    def _dead(self, peer: int) -> socket.socket:
        """Send nothing more to ``peer``: what is queued for it is dropped."""
        dead = _Dead()
        with self.mu:
            self.out[peer] = dead  # type: ignore[assignment]
        return dead  # type: ignore[return-value]

    # ------------------------------------------------------------------ reading

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(sock,), daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        peer = -1
        try:
            hello = _read_frame(sock)
            if hello is None or hello[0][0] != "hello" or hello[0][2] != self.gen:
                sock.close()
                return
            peer = int(hello[0][1])
            with self.mu:
                self.incoming[peer] = sock
            while True:
                got = _read_frame(sock)
                if got is None:
                    break
                try:
                    self.receiver.on_frame(peer, *got)
                except Exception:  # a bug of the twin: say so, keep the connection
                    traceback.print_exc()
            why = "its process exited or closed its twin (its connection closed)"
        except OSError as exc:
            why = f"its connection failed ({exc})"
        if not self.closing and peer >= 0:
            self.receiver.on_gone(peer, why)

    def _watch_out(self, peer: int, sock: socket.socket) -> None:
        """Nothing arrives on a connection this rank opened; its end means the peer left.
        When the peer also opened one to this rank, that reader reports it, after the
        frames still in flight on it."""
        try:
            sock.recv(1)
        except OSError:
            pass
        if self.closing:
            return
        time.sleep(0.3)
        with self.mu:
            reported_elsewhere = peer in self.incoming
        if not reported_elsewhere and not self.closing:
            self._dead(peer)
            self.receiver.on_gone(peer, "its process exited or closed its twin (its connection closed)")

    def close(self) -> None:
        self.closing = True
        with self.mu:
            socks = [*self.out.values(), *self.incoming.values()]
        for s in [self.listener, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class _Dead:
    """Stands for a connection to a peer that left: sending to it drops the frames."""

    def sendall(self, data: bytes) -> None:
        pass

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass
