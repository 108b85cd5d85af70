"""Pipeline runtime: compiled step programs run over stages, weight stores and transports.

The runtime is rooms on floors, each a concept a reader can name: seven wings (sub-packages)
and five modules at the top. A file imports its own room and the rooms below it, never one
above, and nothing imports the facade ``pipeline`` (tests/test_layout.py checks both,
type-only imports included).

- floor 10, ``pipeline``: ``engine.Pipeline``: train a model split into stages with any
  schedule of ALGORITHMS.md
- floor 9, ``ranks/``: One process per stage (gloo/NCCL): build_rank, a rank's lane,
  transports, the mesh (ranks/__init__.py names each file)
- floor 9, ``state/``: What a built pipeline saves and reports (state/__init__.py names each
  file)
- floor 8, ``assemble``: Assembling a pipeline from its stage modules: :func:`build_local` and
  the steps it shares with :func:`~engine.runtime.ranks.rank_build.build_rank`
- floor 7, ``parts``: What a pipeline is made of: the builders' input (:class:`BuildRequest`)
  and output (:class:`PipelineParts`)
- floor 6, ``setup/``: Setting up the pieces: options, stores, balance, L2, step features
  (setup/__init__.py names each file)
- floor 5, ``capture/``: Capture and replay: CUDA graphs of optimizer steps, whole steps and
  asynchronous windows, with their CPU twins (capture/__init__.py names each file)
- floor 4, ``exec/``: Running steps (exec/__init__.py names each file)
- floor 3, ``tensor_parallel``: DTensor stages: local shards in the arena, DTensors in the
  forward
- floor 2, ``stage/``: One stage (stage/__init__.py names each file)
- floor 1, ``precision``: Mixed precision: autocast per stage, dynamic loss scaling
- floor 1, ``ties/``: Tied parameters across stages (ties/__init__.py names each file)
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
