"""Argument checks shared by several modules, so that the same mistake gets the same message.

A leaf module: it imports nothing from ``engine``, so any module (partition, the schedule
generators, the configuration checks) can use it without creating an import cycle.
"""

from __future__ import annotations

__all__ = ["check_positive_int"]


def check_positive_int(what: str, value: object, fix: str) -> int:
    """Return ``value`` if it is an int >= 1.

    Raises ``TypeError("<what> must be an int, got <value!r>")`` for anything that is not an
    int (``bool`` included, although it is a subclass of int, and ``2.0``), and
    ``ValueError("<what> must be >= 1, got <value>; <fix>")`` for an int below 1; ``fix``
    tells the caller what to do instead.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}; {fix}")
    return value
