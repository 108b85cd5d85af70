"""The errors a twin work raises from ``wait()``.

All are ``torch.distributed.DistBackendError`` (a ``RuntimeError``), the type ProcessGroupNCCL
raises for a timed-out or remotely failed work, so code that handles NCCL's errors handles
the twin's; the subclasses let a test say which rule fired.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["TwinError", "DeadlockError", "PeerLeftError", "TwinTimeoutError", "MismatchError"]


class TwinError(dist.DistBackendError):
    """A communication op failed on the NCCL twin."""


class DeadlockError(TwinError):
    """No op progressed anywhere in the job for ``ENGINE_NCCL_TWIN_DEADLOCK_S`` seconds while
    every rank waited: the text names every rank's queue heads."""


class PeerLeftError(TwinError):
    """A rank this op needs exited, or destroyed or aborted the process group."""


class TwinTimeoutError(TwinError):
    """The op did not complete within the group's timeout (NCCL's watchdog) or ``wait(timeout)``."""


class MismatchError(TwinError):
    """The two ends of an op disagree on its size or dtype, or the members of a collective on
    which collective it is (NCCL would corrupt memory or hang)."""
