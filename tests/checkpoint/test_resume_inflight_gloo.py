"""Resume without a flush under gloo: each rank saves and loads its own stage's in-flight
state (including the messages on the wire between ranks); S = RANKS (4 by default, see
distributed_support), a few representative cases,
some through engine.save/engine.load's checkpoint directory, two with tree-valued stages
(a dict with a mask and a constant between stages) and random sequence lengths, two with
on_nonfinite="skip_update" and NaN losses in flight (flags stashed and on the wire)."""

from __future__ import annotations

from typing import Any

import pytest
from distributed_support import RANKS, spawn

NAMES = [
    "pipedream", "2bw", "pb-k2", "pb-spectrain-reuse", "tree-pipedream", "tree-pb-k2", "nan-pb",
    "nan-2bw",
]
THROUGH_DIRECTORY = ("2bw", "pb-k2", "tree-pb-k2", "nan-2bw")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("inflight"))
    kw = dict(S=RANKS, names=NAMES, k=3, steps=6, root=root, dir_names=THROUGH_DIRECTORY)
    return spawn(RANKS, [("resume_inflight", kw)])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_gloo_resume_unflushed_is_bitwise(two: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(two):
        assert "fatal" not in res, res.get("fatal")
        r = res["resume_inflight"][name]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["in_flight"], f"rank {rank}: nothing was in flight at the save"
        if name in THROUGH_DIRECTORY:  # the state the directory holds, not one in memory
            assert r["in_flight_in_file"], (rank, r)
        assert r["losses_equal"] and r["state_equal"], (rank, r)
