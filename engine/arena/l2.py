"""L2 persistence windows over a stage's live buffer (CUDA access-policy windows).

Why a module of its own: it is one self-contained request to the device (validate, pick
the bucket, ask, report what was granted) that shares nothing with slots or pointers. On
a CPU tensor, or in an extension built without CUDA, a request does not raise: it returns
``supported=False`` with the reason, because the same stage code runs on CPU and GPU
machines and a benchmark wants to report "not available" rather than crash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.arena.core import ArenaError
from engine.arena.views import L2Persistence

if TYPE_CHECKING:
    from engine.arena.weight_arena import WeightArena


def request(
    arena: WeightArena, bucket: int | None, hit_ratio: float, max_bytes: int | None, stream: int
) -> L2Persistence:
    """``WeightArena.set_l2_persistence`` with the stream already resolved to a handle."""
    if not 0.0 <= float(hit_ratio) <= 1.0:
        raise ArenaError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
    if max_bytes is not None and max_bytes < 0:
        raise ArenaError(f"max_bytes must be >= 0 (or None for no cap), got {max_bytes}")
    core = arena._core
    if not arena._buckets:
        return L2Persistence(False, False, -1, 0, 0, 0, 0, 0.0, f"arena {arena.name!r} is empty")
    if bucket is None:
        bucket = max(arena._buckets, key=lambda b: int(core.bucket_nbytes(b.index))).index
    arena._check_bucket(bucket)
    r = core.set_l2_persistence(bucket, stream, float(hit_ratio), max_bytes or 0)
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


def clear(arena: WeightArena, bucket: int, stream: int) -> None:
    """``WeightArena.clear_l2_persistence`` with the stream already resolved to a handle."""
    if arena.device.type != "cuda":
        raise ArenaError(
            f"arena {arena.name!r} is on {arena.device}: there is no L2 window to clear"
        )
    arena._core.clear_l2_persistence(arena._check_bucket(bucket), stream)
