"""Old module names kept working for one more release after their module moved.

Why: ``engine.<name>`` imports are public API; a module that moved by concept (a folder that
says what it holds) keeps its old name as a thin module that re-exports the new one and warns
once per process, naming the new import and the release that removes the old name.
"""

from __future__ import annotations

import warnings

__all__ = ["REMOVED_IN", "moved"]

#: the release that removes the old module names
REMOVED_IN = "0.3"


def moved(old: str, new: str) -> None:
    """Warn (DeprecationWarning) that module ``old`` is now ``new``."""
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} is removed in {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )
