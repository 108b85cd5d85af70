"""Moved to :mod:`engine.runtime.capture.audit` (the capture wing); removed in 0.3."""

from engine._deprecation import moved
from engine.runtime.capture.audit import *  # noqa: F403
from engine.runtime.capture.audit import __all__  # noqa: F401

moved(__name__, "engine.runtime.capture.audit")
