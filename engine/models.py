"""Moved to :mod:`engine.demo.models`; this name is removed in 0.3."""

from engine._deprecation import moved
from engine.demo.models import *  # noqa: F403
from engine.demo.models import __all__  # noqa: F401

moved(__name__, "engine.demo.models")
