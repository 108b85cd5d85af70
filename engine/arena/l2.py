"""L2 persistence windows over a stage's live buffer (CUDA access-policy windows).

Why a module of its own: it is one self-contained request to the device (validate, pick
the bucket, ask, report what was granted) that shares nothing with slots or pointers. On
a CPU tensor, or in an extension built without CUDA, a request does not raise: it returns
``supported=False`` with the reason, because the same stage code runs on CPU and GPU
machines and a benchmark wants to report "not available" rather than crash.

Two ways to ask: :func:`request` sets the device-wide set-aside *and* one window (one stage
alone on a GPU, a benchmark); :func:`window` sets only a window with its share of a set-aside
the caller manages with :func:`set_aside` / :func:`reset` (several stages on one GPU, where
each request would overwrite the others' set-aside: engine/runtime/setup/l2.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.arena.core import ArenaError, _core_module
from engine.arena.views import L2Persistence


class ArenaBuckets(Protocol):
    """What these helpers use of a :class:`~engine.arena.weight_arena.WeightArena`: its core
    handle and bucket table (a Protocol: weight_arena imports this module, so naming the
    class closes a circle)."""

    name: str
    device: Any
    _core: Any
    _buckets: Any

    def _check_bucket(self, bucket: int) -> int: ...


def request(
    arena: ArenaBuckets, bucket: int | None, hit_ratio: float, max_bytes: int | None, stream: int
) -> L2Persistence:
    """``WeightArena.set_l2_persistence`` with the stream already resolved to a handle."""
    if not 0.0 <= float(hit_ratio) <= 1.0:
        raise ArenaError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
    if max_bytes is not None and max_bytes < 0:
        raise ArenaError(f"max_bytes must be >= 0 (or None for no cap), got {max_bytes}")
    if not arena._buckets:
        return L2Persistence(False, False, -1, 0, 0, 0, 0, 0.0, f"arena {arena.name!r} is empty")
    bucket = window_bucket(arena) if bucket is None else arena._check_bucket(bucket)
    r = arena._core.set_l2_persistence(bucket, stream, float(hit_ratio), max_bytes or 0)
    return _result(r)


def window_bucket(arena: ArenaBuckets) -> int:
    """The bucket a window covers by default: the largest (a stream has one window)."""
    core = arena._core
    return max(arena._buckets, key=lambda b: int(core.bucket_nbytes(b.index))).index


def window(
    arena: ArenaBuckets, bucket: int | None, hit_ratio: float, share_bytes: int, stream: int
) -> L2Persistence:
    """``WeightArena.set_l2_window`` with the stream already resolved to a handle."""
    if not 0.0 <= float(hit_ratio) <= 1.0:
        raise ArenaError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
    if isinstance(share_bytes, bool) or not isinstance(share_bytes, int) or share_bytes < 0:
        raise ArenaError(f"share_bytes must be an int >= 0, got {share_bytes!r}")
    if not arena._buckets:
        return L2Persistence(False, False, -1, 0, 0, 0, 0, 0.0, f"arena {arena.name!r} is empty")
    bucket = window_bucket(arena) if bucket is None else arena._check_bucket(bucket)
    return _result(arena._core.set_l2_window(bucket, stream, float(hit_ratio), share_bytes))


def _result(r: Any) -> L2Persistence:
    return L2Persistence(
        supported=bool(r["supported"]),
        ok=bool(r["ok"]),
        bucket=int(r["bucket"]),
        granted_bytes=int(r["granted_bytes"]),
        window_bytes=int(r["window_bytes"]),
        max_persisting_bytes=int(r["max_persisting_bytes"]),
        max_window_bytes=int(r["max_window_bytes"]),
        hit_ratio=float(r["hit_ratio"]),
        reason=str(r["reason"]),
    )


def clear(arena: ArenaBuckets, bucket: int, stream: int, *, set_aside_too: bool = True) -> None:
    """``WeightArena.clear_l2_persistence`` (``set_aside_too=False``: ``clear_l2_window``)
    with the stream already resolved to a handle."""
    if arena.device.type != "cuda":
        raise ArenaError(
            f"arena {arena.name!r} is on {arena.device}: there is no L2 window to clear"
        )
    bucket = arena._check_bucket(bucket)
    if set_aside_too:
        arena._core.clear_l2_persistence(bucket, stream)
    else:
        arena._core.clear_l2_window(bucket, stream)


def device_limits(device: int) -> dict[str, Any]:
    """Persisting-L2 facts of CUDA device ``device``: ``supported`` (False in a build without
    CUDA), ``max_persisting_bytes``, ``max_window_bytes``, ``set_aside_bytes`` (the set-aside
    now) and ``reason`` (empty when usable)."""
    return dict(_core_module().l2_device(int(device)))


def set_aside(device: int, nbytes: int) -> dict[str, Any]:
    """Set the device-wide persisting-L2 set-aside of ``device`` to ``nbytes``: ``ok``,
    ``granted_bytes`` (what the device granted), ``reason`` (why not)."""
    return dict(_core_module().set_persisting_l2(int(device), int(nbytes)))


def reset(device: int) -> None:
    """Evict persisting lines on ``device`` and give its set-aside back (limit 0)."""
    _core_module().reset_persisting_l2(int(device))


def clear_window(device: int, stream: int) -> None:
    """Remove the access-policy window from CUDA stream ``stream`` (a cudaStream_t as an int)
    on ``device``; the set-aside and other streams' windows stay."""
    _core_module().clear_stream_window(int(device), int(stream))


def stream_window(device: int, stream: int) -> dict[str, Any]:
    """The window on CUDA stream ``stream`` now: ``base`` (address), ``num_bytes``,
    ``hit_ratio`` (for checks and reports)."""
    return dict(_core_module().stream_window(int(device), int(stream)))
