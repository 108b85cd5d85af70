"""Moved to :mod:`engine.integrations.hf`; this name is removed in 0.3."""

from engine._deprecation import moved
from engine.integrations.hf import *  # noqa: F403
from engine.integrations.hf import __all__  # noqa: F401

moved(__name__, "engine.integrations.hf")
