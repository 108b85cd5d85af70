"""Failures that come from another rank (issue 21, item 4): without torchrun's agent (the
store lives in rank 0's process), a rank killed mid-step makes every survivor raise a
PeerError that names the dead rank -- its neighbours directly, the others through the note
the first neighbour writes (engine/runtime/ranks/first_failure.py) -- within the timeout, also
when the dead rank is rank 0 and the store died with it. No raw gloo error escapes
(``dist.isend`` to a dead peer fails at once: transport/p2p.py turns it into a PeerError)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import RANKS, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

TIMEOUT = 8.0


@pytest.mark.parametrize("victim", [0, RANKS // 2])
def test_every_survivor_names_the_dead_rank(victim: int) -> None:
    results = spawn(RANKS, [("kill", dict(S=RANKS, victim=victim, timeout=TIMEOUT))])
    assert results[victim].get("kill", {"type": None})["type"] is None  # it never reported
    for rank in range(RANKS):
        if rank == victim:
            continue
        got = results[rank]["kill"]
        assert got["type"] == "PeerError", (rank, got)
        assert got["seconds"] < TIMEOUT + 5, (rank, got)
        msg = got["message"]
        if abs(rank - victim) == 1:  # a neighbour names it as its peer
            assert f"stage {victim} (rank {victim})" in msg, msg
        else:
            assert f"The first rank to fail in this job was rank {victim}: lost" in msg, msg
