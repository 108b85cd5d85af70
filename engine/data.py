"""Moved to :mod:`engine.demo.data`; this name is removed in 0.3."""

from engine._deprecation import moved
from engine.demo.data import *  # noqa: F403
from engine.demo.data import __all__  # noqa: F401

moved(__name__, "engine.demo.data")
