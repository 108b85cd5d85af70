"""Moved to :mod:`engine.runtime.capture.audit`; this name is removed in 0.3."""
from engine._deprecation import moved

__all__ = moved(__name__, "engine.runtime.capture.audit", globals())
