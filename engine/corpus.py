"""Moved to :mod:`engine.demo.corpus`; this name is removed in 0.3."""

from engine._deprecation import moved
from engine.demo.corpus import *  # noqa: F403
from engine.demo.corpus import __all__  # noqa: F401

moved(__name__, "engine.demo.corpus")
