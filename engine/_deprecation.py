"""Deprecated spellings that keep working for one more release, and the warning they give.

Why one place: a renamed option or a moved module is public API; the old spelling keeps
working with a DeprecationWarning that names the new spelling and the release that removes
the old one, pointing at the user's line.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

__all__ = ["REMOVED_IN", "deprecated", "moved"]

#: the release that removes the deprecated spellings
REMOVED_IN = "0.3"

_ENGINE = os.path.dirname(os.path.abspath(__file__))


def _caller_level() -> int:
    """The stack level of the first frame outside engine/ (``warnings`` itself skips the
    import machinery's frames when it counts levels, so they are not counted here)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen"):
            if not name.startswith(_ENGINE):
                break
            level += 1
        frame = frame.f_back
    return level


def deprecated(old: str, new: str) -> None:
    """Warn that the spelling ``old`` is deprecated in favour of ``new``."""
    warnings.warn(f"{old} is deprecated and removed in {REMOVED_IN}; use {new}",
                  DeprecationWarning, stacklevel=_caller_level())


def moved(old: str, new: str, namespace: dict[str, Any]) -> list[str]:
    """Module ``old`` (its ``namespace``) is now ``new``: warn, fill the namespace with the new
    module's public names and return them (the old module's ``__all__``)."""
    module = importlib.import_module(new)
    warnings.warn(f"{old} moved to {new}; import it from there ({old} is removed in {REMOVED_IN})",
                  DeprecationWarning, stacklevel=_caller_level())
    namespace.update({name: getattr(module, name) for name in module.__all__})
    return list(module.__all__)
