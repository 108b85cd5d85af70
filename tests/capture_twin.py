"""A CPU twin of a CUDA graph capture: runs the captured step, refusing host syncs.

Why: a CUDA graph capture is invalidated by any op that waits for the device (an
``.item()``, a ``bool()`` of a device tensor, a copy between host and device), and that only
shows on a GPU, at ``capture_end`` (``cudaErrorStreamCaptureInvalidated``). On the H100 the
skip_update step of Adam did one: ``torch._foreach_add_(steps, zero_dim_tensor)`` resolves to
the Scalar overload, an ``.item()`` (issue 22). The ops are the same on the CPU, so
:class:`SyncFreeCapture`, used as engine.runtime.capture.optimizer_graphs' backend, runs the step under a
dispatch mode that fails on every op that would wait for the device or cross devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ops that read a device value on the host (the caller waits for the device)
HOST_SYNC_OPS = {
    "aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
    "aten.equal.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default",
}
_COPIES = {"aten._to_copy.default", "aten.copy_.default"}


class HostSyncError(AssertionError):
    """An op inside a (twin) capture that a CUDA graph capture would not survive."""


def _devices(x: Any) -> set[torch.device]:
    out = set()
    for t in x if isinstance(x, (list, tuple)) else [x]:
        if isinstance(t, torch.Tensor):
            out.add(t.device)
    return out


class NoHostSync(TorchDispatchMode):
    """Records every aten op; raises :class:`HostSyncError` at a host sync or a copy between
    devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops.append(name)
        if name in HOST_SYNC_OPS:
            raise HostSyncError(f"{name} inside a captured step (a host sync: the capture of "
                                "a CUDA graph is invalidated by it)")
        out = func(*args, **kwargs)
        if name in _COPIES:
            devices = _devices(args[0]) | _devices(args[1] if len(args) > 1 else None) | _devices(out)
            if len(devices) > 1:
                raise HostSyncError(f"{name} between {sorted(map(str, devices))} inside a "
                                    "captured step")
        return out


class SyncFreeCapture:
    """engine.runtime.capture.optimizer_graphs backend: nothing runs at "capture" (as with a real graph); the
    first replay, which StepGraphs runs right after the capture, runs the step under
    :class:`NoHostSync` and keeps its op list, later replays run it plainly."""

    def __init__(self) -> None:
        self.captured: list[list[str]] = []

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        first = [True]

        def replay() -> None:
            if not first[0]:
                step()
                return
            first[0] = False
            mode = NoHostSync()
            with mode:
                step()
            self.captured.append(mode.ops)

        return replay
