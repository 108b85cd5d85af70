"""Activation offload (``Pipeline(offload_activations=True)``): saved activations wait for
their backward in host memory (pinned on CUDA) instead of on the device.

Why not ``torch.autograd.graph.save_on_cpu`` as it is: it moves *every* saved tensor,
weights included. A stage's forward saves views of the weight buffer it ran on, and which
values the backward reads through them is part of each schedule's semantics (the live
weights after later updates for synchronous schedules and pb, a stashed version for
pipedream: engine/runtime/stage/stage.py). A host copy taken at the forward would freeze them, and
copying weights twice per micro-batch would cost more than it saves. So the hooks here are
save_on_cpu's with one rule added: a saved tensor that shares storage with the stage's
parameters (the buffer the forward runs on) stays where it is; everything else is copied to
host memory at the forward (``non_blocking`` into pinned memory on CUDA, ordered on the
stage's stream) and back at the backward. Values are copied, never changed: results are
bit for bit those without offload.

Composition with recomputation: a stage that recomputes (``checkpoint``) keeps no
activations but its input, which the activation stash holds for the backward anyway; its
forward runs under torch.utils.checkpoint's own hooks, so offload applies to the stages that
do not recompute. The mitigations that re-point saved weights at another buffer (LWP,
PipeMare T2 and SpecTrain without recomputation: engine/runtime/stage/saved_weights.py) install
their own hooks for the same tensors, and are refused with offload.

``stats()["activation_bytes"]`` reports per stage the peak bytes of saved activations held on
the host (what the device would hold without offload) and the bytes held now.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ActivationOffload"]


class ActivationOffload:
    """The saved-tensor hooks of one stage (module docstring)."""

    def __init__(self, module: nn.Module, pin: bool) -> None:
        self.module = module
        self.pin = pin
        self.host_bytes = 0  # saved activations in host memory now
        self.peak_host_bytes = 0
        self._weights: set[int] = set()

    def _pack(self, t: Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self._weights:
            return (None, t)  # a view of the weights the forward ran on: stays (docstring)
        if _dense(t):  # the same strides back: the backward's kernels see what they saw
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=self.pin)
        else:
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        n = host.numel() * host.element_size()
        self.host_bytes += n
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(host, self._freed, n)
        return (t.device, host)

    def _freed(self, n: int) -> None:
        self.host_bytes -= n

    def _unpack(self, packed: Any) -> Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=self.pin)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """The forward's saved tensors go to host memory while inside."""
        self._weights = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def stats(self) -> dict[str, int]:
        return {"host_peak": self.peak_host_bytes, "host_now": self.host_bytes}


def _dense(t: Tensor) -> bool:
    """Strided, no element twice, no gap: a copy with the same strides is well defined."""
    if t.layout != torch.strided or any(st <= 0 for st, n in zip(t.stride(), t.size()) if n > 1):
        return False
    span = 1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride()) if n > 0)
    return span == t.numel()
