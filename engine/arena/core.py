"""What every part of the arena package shares: its errors, the compiled core, alignment.

Why a module of its own: the value types, the registry, the arena and ``flatten_`` all
raise the same errors and reach the same extension; keeping those here lets each of them
import only downwards (core <- views <- registry, double_buffer, l2 <- weight_arena <-
flatten), without cycles.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ArenaError, SlotError

__all__ = ["ArenaError", "SlotError", "DEFAULT_ALIGNMENT"]

DEFAULT_ALIGNMENT = 256


def _core_module() -> Any:
    try:
        from engine import _C
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(
            "engine._C (the compiled weight arena) is not importable: "
            f"{exc}. Build it with `pip install --no-build-isolation -e .` "
            "(see docs/building.md)."
        ) from exc
    return _C


def _check_alignment(alignment: int) -> None:
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise ArenaError(
            f"alignment must be a positive power of two in bytes (e.g. 256), got {alignment!r}"
        )
