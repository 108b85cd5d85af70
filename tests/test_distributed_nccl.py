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
