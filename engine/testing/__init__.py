"""Test instrumentation that ships with the library: layers that record which weights each
forward and backward of a pipeline read, and a fault injector for exception-safety tests."""

from __future__ import annotations

from engine.testing.faults import FaultInjector, InjectedFault
from engine.testing.probe import Probe

__all__ = ["Probe", "FaultInjector", "InjectedFault"]
