"""Test configuration shared by every test module.

Triton reads TRITON_INTERPRET when the module that defines a kernel is imported, so it has
to be set here, before any test imports engine.triton_kernels. On a machine without a GPU the
kernels run through the interpreter; on a GPU machine they are compiled.
"""

from __future__ import annotations

import importlib.machinery
import os
import signal
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The test files live in folders that mirror engine/ (tests/runtime/, tests/optim/, ...); the
# support modules beside this file and the test modules themselves are imported by their bare
# names (``import distributed_support``; a spawned rank's phase "test_transport_nccl_twin:x"),
# from any folder and in the worker processes distributed tests spawn, which inherit
# sys.path. So tests/ and every folder under it that holds test modules go on sys.path.
_TESTS = Path(__file__).resolve().parent
for _folder in sorted({p.parent for p in _TESTS.rglob("test_*.py")} | {_TESTS}, reverse=True):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def _hypothesis_stand_in() -> types.ModuleType:
    """A ``hypothesis`` module whose ``@given`` tests skip with a reason.

    GPU machines may lack hypothesis (no network to install it). Without this, every test
    module that imports it would fail to collect, and its example-based tests -- the compiled
    kernel tests among them -- would not run where they matter most.
    """
    module = types.ModuleType("hypothesis")
    strategies = types.ModuleType("hypothesis.strategies")
    for mod in (module, strategies):  # importlib.util.find_spec (torch._dynamo) needs a spec
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)

    def given(*_args: object, **_kwargs: object):
        return pytest.mark.skip(reason="hypothesis is not installed (property test)")

    def settings(*_args: object, **_kwargs: object):
        return lambda fn: fn

    def anything(name: str) -> object:
        if name.startswith("__"):  # keep inspect/pickle from mistaking this for a real module
            raise AttributeError(name)
        return lambda *a, **k: None

    class _Anything:
        def __getattr__(self, name: str) -> object:
            return anything(name)

    module.given, module.settings = given, settings
    module.HealthCheck = _Anything()
    module.strategies = strategies
    strategies.__getattr__ = anything  # type: ignore[attr-defined]
    return module


try:
    import hypothesis  # noqa: F401
except ImportError:
    sys.modules["hypothesis"] = _hypothesis_stand_in()
    sys.modules["hypothesis.strategies"] = sys.modules["hypothesis"].strategies


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt during the test, as in a process started in a terminal.

    Why: a process started in the background (``pytest ... &``, ``nohup``, many CI wrappers)
    inherits SIGINT as ignored, and Python then installs no handler; the engine leaves an
    ignored SIGINT ignored (engine/runtime/exec/interrupts.py). A test that sends itself a
    Ctrl-C, or checks the handler a step restores, sets the handler it relies on with this
    fixture (tests/runtime/test_interrupts.py checks that every such module does).
    """
    if threading.current_thread() is not threading.main_thread():  # pragma: no cover
        pytest.skip("SIGINT handlers can only be set from the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run .ci/gpu on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
