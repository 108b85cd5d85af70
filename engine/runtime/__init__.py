"""Pipeline runtime: compiled step programs run over stages, weight stores and transports.

The runtime is five wings (sub-packages) and three modules at the top, on floors: a file
imports its own room and the rooms below it, never one above, and nothing imports the facade
``pipeline`` (tests/test_layout.py checks both, type-only imports included).

- floor 7, ``pipeline``: ``engine.Pipeline``: train a model split into stages with any schedule
  of ALGORITHMS.md
- floor 6, ``ranks/``: One process per stage (gloo/NCCL) (ranks/__init__.py names each file)
- floor 6, ``state/``: What a built pipeline saves and reports (state/__init__.py names each
  file)
- floor 5, ``assemble``: Assembling a pipeline from its stage modules: :func:`build_local` and
  the steps it shares with :func:`~engine.runtime.ranks.rank_build.build_rank`
- floor 4, ``parts``: What a pipeline is made of: the builders' input (:class:`BuildRequest`)
  and output (:class:`PipelineParts`)
- floor 3, ``setup/``: Building the pieces (setup/__init__.py names each file)
- floor 2, ``exec/``: Running steps (exec/__init__.py names each file)
- floor 1, ``stage/``: One stage (stage/__init__.py names each file)
"""

from __future__ import annotations

import importlib
from typing import Any

#: the runtime's public names, where they are defined: documentation cites them here, so
#: they do not move when a file moves between wings
_LAZY = {
    "Pipeline": "engine.runtime.pipeline",
    "DEFAULT_CHECKPOINT": "engine.runtime.setup.config",
    "Outcome": "engine.runtime.exec.failures",
}

__all__ = ["Pipeline", "DEFAULT_CHECKPOINT", "Outcome"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
