"""The names of the delay mitigations, one list each (torch-free, so the command line can
read them without importing torch).

Why a module: the pipeline's options (:mod:`engine.runtime.setup.config`), the command line
(:mod:`engine.cli.config`) and the ranks' settings agreement (:mod:`engine.runtime.ranks.agreement`)
each need these lists; written once here, a new mitigation cannot be known to one and not
the others. Which schedules the mitigations apply to is a schedule fact:
:attr:`engine.schedule.catalog.Family.live_async`.
"""

from __future__ import annotations

__all__ = ["MITIGATION_OPTIONS", "WEIGHT_PREDICTIONS"]

#: values of ``Pipeline(weight_prediction=...)`` and of ``train --prediction``
WEIGHT_PREDICTIONS: tuple[str, ...] = ("lwp", "spectrain", "spectrain_reuse")

#: the engine optimizer options that mitigate gradient delay (ALGORITHMS.md); each is off when
#: None, False or 0
MITIGATION_OPTIONS: tuple[str, ...] = (
    "spike_compensation",
    "prediction",
    "discrepancy_correction",
    "delay_compensation",
)
