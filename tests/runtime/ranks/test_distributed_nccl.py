"""NCCL transport: one GPU per rank, communication on its own stream. The same phases as the
gloo tests, compared with the local run on the same GPU type (values up to GPU arithmetic).

Needs at least 2 GPUs (marked ``cuda`` and ``distributed``; skipped elsewhere).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL allows one rank per GPU: needs >= 2 GPUs",
    ),
]


def test_nccl_two_ranks_match_local() -> None:
    from distributed_support import configs, spawn

    results = spawn(2, [("equal", dict(S=2, names=None, transport="nccl"))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name in configs(2):
            got = res["equal"][name]
            assert "error" not in got, f"rank {rank} {name}: {got.get('error')}"
            assert got["max_diff"] < 1e-5, (rank, name, got)
            assert got["updates"] == got["ref_updates"]


def test_nccl_skip_update_flags_travel_on_the_device() -> None:
    """on_nonfinite="skip_update" under NCCL: the flags ride with the gradients (CUDA
    tensors, no host read); the same updates are skipped as in the local run."""
    from distributed_support import spawn
    from test_distributed_gloo import SKIP_UPDATE

    results = spawn(2, [("skip_update", dict(S=2, names=SKIP_UPDATE, transport="nccl"))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name in SKIP_UPDATE:
            got = res["skip_update"][name]
            assert "error" not in got, f"rank {rank} {name}: {got.get('error')}"
            assert got["finite"] and got["max_diff"] < 1e-5, (rank, name, got)
            assert got["nan_losses"] == got["ref_nan_losses"], (rank, name, got)
            assert got["skipped"] == got["ref_skipped"] > 0, (rank, name, got)
