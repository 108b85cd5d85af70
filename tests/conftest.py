"""Test configuration shared by every test module.

Triton reads TRITON_INTERPRET when the module that defines a kernel is imported, so it has
to be set here, before any test imports triton_kernels. On a machine without a GPU the
kernels run through the interpreter; on a GPU machine they are compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run .ci/gpu on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
