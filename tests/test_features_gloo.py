"""Step features across processes (gloo): clipping's global norm spans every rank's stages
(bit for bit the local run with one replica; with data-parallel replicas equal to one replica
with the larger batch up to the rounding of the replica mean)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from features_dist_support import spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


def _ok(results: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    out = []
    for res in results:
        assert "fatal" not in res, res.get("fatal")
        assert phase in res, res
        for name, r in res[phase].items():
            assert "error" not in r, f"{name}: {r['error']}"
        out.append(res[phase])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_clip_under_gloo_equals_the_local_run(world: int) -> None:
    for rank_res in _ok(spawn(world, [("clip", dict(S=world))]), "clip"):
        assert len(rank_res) == 7
        for name, r in rank_res.items():
            assert r["weights_equal"] and r["losses_equal"], (name, r)
            assert r["norm"] == r["ref_norm"], (name, r)


def test_clip_with_data_parallel_replicas() -> None:
    for rank_res in _ok(spawn(4, [("clip", dict(S=2, R=2))]), "clip"):
        assert set(rank_res) == {"gpipe", "pipedream"}
        for name, r in rank_res.items():
            assert r["max_diff"] < 1e-5, (name, r)
            assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], (name, r)
            assert r["ref_norm"] > 0.02  # the runs clip
