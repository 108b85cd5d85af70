"""pipeline-engine: pipeline-parallel training for PyTorch.

Every schedule of the pipeline-parallel literature (synchronous and asynchronous), the
staleness mitigations that make the asynchronous ones train well, fused Triton optimizer
steps, and a C++ arena that keeps each stage's weights in flat, aligned buffers.

Heavy pieces (the compiled extension, Triton) load on first use so that ``import engine``
stays cheap and works on machines that have neither a GPU nor a built extension yet.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

from engine._version import __version__


class _TorchBeforeExtension(importlib.abc.MetaPathFinder):
    # engine/_C*.so links libc10/libtorch, which the dynamic loader finds only after `import torch`
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "engine._C":
            import torch  # noqa: F401
        return None  # the normal finders load the module


sys.meta_path.insert(0, _TorchBeforeExtension())

# public name -> module that defines it; resolved lazily by __getattr__ below
_LAZY: dict[str, str] = {
    "WeightArena": "engine.arena",
    "flatten_": "engine.arena",
    "Pipeline": "engine.runtime.pipeline",
    "save": "engine.checkpoint",
    "load": "engine.checkpoint",
    "export": "engine.model_file",
    "named_stage": "engine.model_names",
    "optim": "engine.optim",
    "schedule": "engine.schedule",
    "partition": "engine.partition",
    "testing": "engine.testing",
    # every public exception, from the leaf module engine.errors
    "ArenaError": "engine.errors",
    "CheckpointError": "engine.errors",
    "NonFiniteLossError": "engine.errors",
    "NotFlushedError": "engine.errors",
    "PeerError": "engine.errors",
    "PeerStepError": "engine.errors",
    "PipelineConfigError": "engine.errors",
    "PipelineInputError": "engine.errors",
    "ScheduleError": "engine.errors",
    "ShapeAgreementError": "engine.errors",
    "SlotError": "engine.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"engine.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
