"""Shared-memory messages between neighbouring ranks on one host (transport/shm.py).

* A ring carries any dtype and size, wraps around, matches receives per (peer, tag) in
  posting order whichever comes first, takes a message shorter than its buffer (the
  transport's fills), refuses a longer one, and sends what does not fit through gloo
  (a redirect record keeps the order).
* A silent peer times out with gloo's wording ("timed out": a PeerError that says so); a dead
  one is a broken connection within a fraction of a second, not after the timeout.
* In a gloo pipeline on one host the neighbours' messages go through rings and the run
  equals the local run bit for bit, also with a ring so small that most activations are
  redirected; ``ENGINE_SHM=0`` keeps gloo, and where only one end can share memory both
  ends agree on gloo; virtual stages across processes (interleaved) get rings per boundary;
  a bad ring size is a clear error.

Cost: one 2-process spawn, ~6 s on 2 cores; the rest runs in one process.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_support import spawn, stage_factories
from torch import nn

from engine.runtime.ranks.transport import shm

needs_shm = pytest.mark.skipif(not shm.enabled(), reason="no futex/shared memory here (Linux x86-64)")


class _Gloo:
    """Two ends of a fake gloo: what one sends on (peer, tag), the other receives in order."""

    queues: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def __init__(self, me: int) -> None:
        self.me = me

    def send(self, t: torch.Tensor, peer: int, tag: int) -> Any:
        self.queues.setdefault((self.me, peer, tag), []).append(t.clone())
        return shm._SENT

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        buf.copy_(self.queues[(src, self.me, tag)].pop(0))
        return shm._SENT

    def forget(self) -> None:
        pass


def _pair(tmp: str, kb: int = 128) -> tuple[shm.SharedMemoryCalls, shm.SharedMemoryCalls]:
    """Ranks 0 and 1 in this process, joined by two rings of ``kb`` KiB."""
    _Gloo.queues = {}
    rings = {}
    for src, dst in ((0, 1), (1, 0)):
        path = os.path.join(tmp, f"ring-{src}-{dst}")
        rings[(src, dst)] = (shm.Ring(path, kb * 1024, create=True), shm.Ring(path, 0, create=False))
        os.unlink(path)
    a = shm.SharedMemoryCalls(_Gloo(0), {1: (rings[(0, 1)][0], rings[(1, 0)][1])})
    b = shm.SharedMemoryCalls(_Gloo(1), {0: (rings[(1, 0)][0], rings[(0, 1)][1])})
    return a, b


@pytest.fixture
def tmp_shm(tmp_path: Any) -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)


def _value(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    return (torch.randn(n, generator=g) * 100).to(dtype)


@needs_shm
def test_every_dtype_and_size_arrives_whole_through_a_wrapping_ring(tmp_shm: str) -> None:
    a, b = _pair(tmp_shm)  # 128 KiB: 300 messages up to 160 KB wrap it many times
    rnd, g = random.Random(0), torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
              torch.int8, torch.bool, torch.complex64]
    for i in range(300):
        x = _value(rnd.choice([0, 1, 3, 7, 129, 4097, 20011]), rnd.choice(dtypes), g)
        buf = torch.empty_like(x)
        tag = rnd.choice([0, 8, 9])
        if i % 2:  # the record arrives first, kept until its receive
            sent, got = a.send(x, 1, tag), b.recv(buf, 0, tag)
        else:
            got, sent = b.recv(buf, 0, tag), a.send(x, 1, tag)
        sent.wait()
        got.wait(2.0)
        assert torch.equal(buf.view(torch.uint8), x.view(torch.uint8)), (i, x.dtype, x.numel())
    assert a.redirected > 0  # the largest (> ring - reserve) went through "gloo"


@needs_shm
def test_receives_match_in_posting_order_per_tag(tmp_shm: str) -> None:
    a, b = _pair(tmp_shm)
    for i in range(6):
        a.send(torch.full((5,), float(i)), 1, i % 2)
    bufs = [torch.empty(5) for _ in range(6)]
    works = [b.recv(buf, 0, 1 if k < 3 else 0) for k, buf in enumerate(bufs)]  # tag 1 first
    for w in works:
        w.wait(2.0)
    assert [int(x[0]) for x in bufs] == [1, 3, 5, 0, 2, 4]  # tag 1 took 1, 3, 5 in order


@needs_shm
def test_a_short_message_fills_the_front_of_a_larger_buffer_and_a_long_one_is_refused(
    tmp_shm: str,
) -> None:
    a, b = _pair(tmp_shm)
    a.send(torch.ones(1, dtype=torch.uint8), 1, 0)
    big = torch.zeros(4)
    b.recv(big, 0, 0).wait(2.0)
    assert big.view(torch.uint8)[:2].tolist() == [1, 0]
    a.send(torch.ones(20), 1, 0)
    with pytest.raises(RuntimeError, match="80-byte message from rank 0 .* for a 40-byte receive"):
        b.recv(torch.zeros(10), 0, 0).wait(2.0)


@needs_shm
def test_a_silent_peer_times_out_in_gloos_words(tmp_shm: str) -> None:
    _a, b = _pair(tmp_shm)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 0.3s for a message from rank 0"):
        b.recv(torch.zeros(3), 0, 0).wait(0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0


@needs_shm
def test_a_dead_peer_is_a_broken_connection_at_once(tmp_shm: str) -> None:
    _a, b = _pair(tmp_shm)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process
    ring = b.rings[0][1]
    struct.pack_into("<IQ", ring.mm, 20, gone.pid, 12345)  # the ring's writer is that process
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"Connection closed by peer: rank 0 \\(pid {gone.pid}\\)"):
        b.recv(torch.zeros(3), 0, 0).wait(30.0)
    assert time.monotonic() - t0 < 2.0  # LIVENESS_S, not the 30 s timeout


@needs_shm
def test_a_ring_whose_reader_stopped_fills_up_and_the_send_says_so(
    tmp_shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _b = _pair(tmp_shm, kb=128)
    monkeypatch.setattr(shm, "RESERVE", 128 * 1024)  # every message is redirected ...
    monkeypatch.setattr(shm, "FULL_WAIT_S", 0.2)
    for _ in range(128 * 1024 // 16):  # ... until the ring is full of redirect records
        a.send(torch.zeros(2), 1, 0)
    assert a.redirected == 128 * 1024 // 16
    with pytest.raises(RuntimeError, match="ring to rank 1 stayed full for 0.2s"):
        a.send(torch.zeros(2), 1, 0)


@needs_shm
def test_released_calls_refuse(tmp_shm: str) -> None:
    a, _b = _pair(tmp_shm)
    a.forget()
    with pytest.raises(RuntimeError, match="released"):
        a.send(torch.zeros(1), 1, 0)


def test_shm_can_be_switched_off_and_a_bad_ring_size_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_SHM", "0")
    assert not shm.enabled()
    monkeypatch.setenv("ENGINE_SHM_RING_KB", "64")
    with pytest.raises(ValueError, match="ENGINE_SHM_RING_KB='64'.*at least 128"):
        shm._ring_bytes()
    monkeypatch.setenv("ENGINE_SHM_RING_KB", "lots")
    with pytest.raises(ValueError, match="ENGINE_SHM_RING_KB='lots'"):
        shm._ring_bytes()


# ---------------------------------------------------------------------- two processes


class Wide(nn.Module):
    """Stage 0 widens to ``width`` features, so each activation is 8 x width floats."""

    def __init__(self, s: int, width: int) -> None:
        super().__init__()
        torch.manual_seed(2000 + s)
        self.lin = nn.Linear(6 if s == 0 else width, width if s == 0 else 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _shm_env(on: str, ring_kb: str | None = None) -> None:
    """This rank's shared-memory settings for the pipeline a phase builds next."""
    os.environ["ENGINE_SHM"] = on
    os.environ.pop("ENGINE_SHM_RING_KB", None)
    if ring_kb is not None:
        os.environ["ENGINE_SHM_RING_KB"] = ring_kb


def _rings(S: int, ring_kb: str | None, width: int, on: str) -> dict[str, Any]:
    """A 1F1B run over rings of ``ring_kb`` KiB (None: the default) against the local run."""
    import functools

    from engine import Pipeline

    _shm_env(on, ring_kb)
    kw = dict(schedule="1f1b", chunks=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    factories = [functools.partial(Wide, s, width) for s in range(S)] if width else stage_factories(S)
    pipe = Pipeline(factories, loss_fn=nn.functional.mse_loss, transport="gloo", timeout=30, **kw)
    ref = Pipeline([f() for f in factories], loss_fn=nn.functional.mse_loss, **kw)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)) for _ in range(4)]
    losses = [pipe.step(x, y).detach().clone() for x, y in data]
    ref_losses = [ref.step(x, y).detach().clone() for x, y in data]
    mine = list(pipe.stages[0].module.parameters())
    theirs = list(ref.stages[pipe.layout.stage].module.parameters())
    calls = pipe.parts.rank.transport.calls
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        and all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
        "calls": type(calls).__name__,
        "peers": calls.peers() if hasattr(calls, "peers") else [],
        "redirected": getattr(calls, "redirected", 0),
    }


def phase_default_ring(rank: int, S: int) -> dict[str, Any]:
    return _rings(S, None, 0, "1")


def phase_small_ring(rank: int, S: int) -> dict[str, Any]:
    return _rings(S, "128", 4096, "1")


def phase_switched_off(rank: int, S: int) -> dict[str, Any]:
    return _rings(S, None, 0, "0")


def phase_one_end_off(rank: int, S: int) -> dict[str, Any]:
    """Only rank 0 has ``ENGINE_SHM=0`` (as a rank on another host, or without /dev/shm room,
    would be): the pair agrees on gloo at both ends instead of waiting on a ring."""
    return _rings(S, None, 0, "0" if rank == 0 else "1")


def phase_virtual(rank: int, S: int) -> dict[str, Any]:
    """Interleaved 1F1B, 2 virtual stages per rank: each boundary between the two ranks is a
    transport of its own, set up in increasing boundary order on both ranks, with rings."""
    from engine import Pipeline

    _shm_env("1")
    kw = dict(schedule="interleaved", virtual_stages=2, chunks=4,
              optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    factories = stage_factories(2 * S)
    pipe = Pipeline(factories, loss_fn=nn.functional.mse_loss, transport="gloo", timeout=30, **kw)
    ref = Pipeline([f() for f in factories], loss_fn=nn.functional.mse_loss, **kw)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    equal = all(torch.equal(pipe.step(x, y), ref.step(x, y)) for x, y in data)
    for st in pipe.stages:
        mine, theirs = st.module.parameters(), ref.stages[st.index].module.parameters()
        equal &= all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    sides = [side for tp in pipe.parts.rank.transports.values() for side in tp.sides]
    return {"equal": equal, "calls": sorted(type(getattr(t, "calls", t)).__name__ for t in sides)}


def phase_bad_size_on_one_rank(rank: int, S: int) -> dict[str, Any]:
    """Rank 1 alone has a bad ``ENGINE_SHM_RING_KB``: it raises naming the setting after the
    setup's collective calls, so rank 0 is not left waiting in them (it fails at its first
    step, when rank 1 is gone, instead of hanging). The last phase: rank 1 leaves after it."""
    from engine import Pipeline

    _shm_env("1", "64" if rank == 1 else "4096")
    t0 = time.perf_counter()
    try:
        pipe = Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, transport="gloo",
                        timeout=60, schedule="1f1b", chunks=2,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        if rank == 0:
            g = torch.Generator().manual_seed(7)
            pipe.step(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 -- what each rank saw is the result
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}


PHASES = ("default_ring", "small_ring", "switched_off", "one_end_off", "virtual")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    phases = [*PHASES, "bad_size_on_one_rank"]
    return spawn(2, [(f"test_transport_shm:{name}", dict(S=2)) for name in phases], timeout=150)


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@needs_shm
def test_neighbours_on_one_host_talk_through_rings_and_train_as_the_local_run(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in range(2):
        res = two_ranks[rank]
        assert res and "fatal" not in res, f"rank {rank}: {res.get('fatal', 'no result')}"
        default, small, off, one, virtual = (res[f"test_transport_shm:{name}"] for name in PHASES)
        assert default["calls"] == "SharedMemoryCalls" and default["peers"] == [1 - rank], default
        assert default["equal"] and default["redirected"] == 0, (rank, default)
        # 32/4 x 4096 floats = 128 KiB activations and gradients, more than a 128 KiB ring
        # takes beside its reserve: each goes through gloo behind a redirect record, in order
        assert small["equal"] and small["redirected"] > 0, (rank, small)
        assert off["calls"] == "GroupCalls" and off["equal"], (rank, off)
        assert one["equal"] and one["peers"] == [], (rank, one)  # rank 1 holds no ring either
        # stages 0-3 on ranks 0, 1, 0, 1: three boundaries, each side between the two ranks
        assert virtual["equal"], (rank, virtual)
        assert virtual["calls"] == ["SharedMemoryCalls"] * 3, (rank, virtual)


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@needs_shm
def test_a_bad_ring_size_on_one_rank_is_named_there_and_leaves_no_peer_waiting(
    two_ranks: list[dict[str, Any]],
) -> None:
    bad = two_ranks[1]["test_transport_shm:bad_size_on_one_rank"]
    assert bad["error"] is not None and "ENGINE_SHM_RING_KB='64'" in bad["error"], bad
    other = two_ranks[0]["test_transport_shm:bad_size_on_one_rank"]
    # built (the setup's collectives completed), then its first step found rank 1 gone
    assert other["error"] is not None and "PeerError" in other["error"], other
    assert other["seconds"] < 50, other  # a broken connection, not the 60 s timeout
