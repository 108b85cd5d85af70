"""Moved to :mod:`engine.demo.models`; this name is removed in 0.3."""
from engine._deprecation import moved

__all__ = moved(__name__, "engine.demo.models", globals())
