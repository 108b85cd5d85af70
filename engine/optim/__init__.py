"""Drop-in torch.optim optimizers that know about pipeline delay (staleness).

``SGD``, ``Adam``, ``AdamW``, ``NAdam`` and ``Muon`` are ``torch.optim.Optimizer`` subclasses:
with ``delay=0`` and the mitigation options off they equal torch.optim's results bit for bit
on CPU (Muon: torch.optim.Muon on 2-D params, torch.optim.AdamW on the others). Per param
group they also take the delay D_s of their pipeline stage and the staleness mitigations of
ALGORITHMS.md (spike compensation, weight prediction, PipeMare's discrepancy correction),
the same keywords in each (``DelayOptions``: their one list, defaults and check);
``PipeMareLR`` is PipeMare's learning-rate rescheduling (T1). Updates run as fused Triton
kernels on CUDA (``fused=None``) and over the C++ arena's flat buffers when the params live
there; ``engine.optim.functional`` is the readable reference math. ``BasisRotation`` (Adam in
the gradients' eigenbasis, Jung et al. 2026) is matrix work: a plain torch optimizer over
per-matrix tensors, without the delay options or a fused path.
"""

from __future__ import annotations

from engine.optim.adam import Adam, AdamW
from engine.optim.base import PREDICTION_MODES, DelayOptimizer
from engine.optim.basis_rotation import BasisRotation
from engine.optim.lr_scheduler import PipeMareLR
from engine.optim.muon import Muon
from engine.optim.nadam import NAdam
from engine.optim.options import DelayOptions
from engine.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "NAdam", "Muon", "BasisRotation", "PipeMareLR", "DelayOptimizer",
           "DelayOptions", "PREDICTION_MODES"]
