"""What a synchronous step restores when it fails: RNG states and module buffers.

Why: a failed synchronous step must leave *nothing* changed -- "the step never happened" is
the only state a user can reason about after a Ctrl-C or a bad batch. Weights and optimizer
state are untouched until the step's update phase, and gradients are simply zeroed, but two
things change during the forwards: the random number generators (dropout draws) and module
buffers such as BatchNorm's running statistics.

RNG states are cheap to save (a few KB per device). Buffers could be large (a causal mask), so
only buffers that a forward has been seen to modify are copied at the start of a step: a
buffer changed if its value, its autograd version counter or its identity (the module
replaced it) changed. Until the first step has shown which buffers change, every buffer is
copied; a buffer first modified by a failing step is restored from that copy.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RollbackPoint", "BufferTracker"]


class BufferTracker:
    """The floating and integer buffers of some modules, and which of them steps modify."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self._slots: list[tuple[nn.Module, str]] = []
        for m in modules:
            for sub in m.modules():
                for name, buf in sub.named_buffers(recurse=False):
                    if buf is not None:
                        self._slots.append((sub, name))
        self._mutable: set[int] | None = None  # indices into _slots; None: not known yet

    def capture(self) -> list[tuple[int, Tensor, int, Tensor | None]]:
        """(slot, tensor object, version, copy or None) for every buffer."""
        out = []
        for k, (mod, name) in enumerate(self._slots):
            t = getattr(mod, name)
            if not isinstance(t, Tensor):
                continue
            copy = t.detach().clone() if (self._mutable is None or k in self._mutable) else None
            out.append((k, t, t._version, copy))
        return out

    def learn(self, captured: list[tuple[int, Tensor, int, Tensor | None]]) -> None:
        """After a step: remember which buffers it modified (they are copied from now on).
        A kernel may write a buffer without bumping its version counter (BatchNorm's running
        statistics), so buffers that were copied are also compared by value."""
        changed = set() if self._mutable is None else set(self._mutable)
        for k, t, version, copy in captured:
            mod, name = self._slots[k]
            now = getattr(mod, name)
            if (
                now is not t
                or t._version != version
                or (copy is not None and not torch.equal(copy, t))
            ):
                changed.add(k)
        self._mutable = changed

    def restore(self, captured: list[tuple[int, Tensor, int, Tensor | None]]) -> list[str]:
        """Put every buffer back; returns the names of buffers that could not be restored
        (modified in place for the first time, with no copy taken)."""
        lost = []
        with torch.no_grad():
            for k, t, version, copy in captured:
                mod, name = self._slots[k]
                if getattr(mod, name) is not t:
                    setattr(mod, name, t)
                if copy is not None:
                    t.copy_(copy)
                elif t._version != version:
                    lost.append(name)
                    if self._mutable is not None:
                        self._mutable.add(k)
        return lost


class RollbackPoint:
    """The RNG states and buffers at the start of a synchronous step."""

    def __init__(self, tracker: BufferTracker, cuda_devices: list[int]) -> None:
        self.tracker = tracker
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: list[tuple[int, Any]] = [
            (d, torch.cuda.get_rng_state(d)) for d in cuda_devices
        ]
        self.buffers = tracker.capture()

    def commit(self) -> None:
        """The step succeeded: learn which buffers it changed."""
        self.tracker.learn(self.buffers)

    def restore(self, stacklevel: int = 4) -> list[str]:
        """Put the RNG states and buffers back; warn about (and return) the buffers that
        could not be restored. ``stacklevel`` points the warning at the user's step() call."""
        torch.set_rng_state(self.cpu_rng)
        for d, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, d)
        lost = self.tracker.restore(self.buffers)
        if lost:
            warnings.warn(
                f"rolling back a failed step could not restore buffers {lost}: they were "
                "modified in place for the first time; they keep the failed step's values",
                RuntimeWarning,
                stacklevel=stacklevel + 1,
            )
        return lost
