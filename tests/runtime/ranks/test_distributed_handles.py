"""Asynchronous schedules never flush between steps, so every work a rank holds must be
released from the schedule itself, not at the next flush. gloo's ``Work.is_completed()``
stays False until ``wait()``: a sent gradient is released once the previous stage's action
stream proves it consumed (it sent an activation after the backward of that gradient, see
engine/runtime/ranks/transport/p2p.py). Here: S = 3 processes, 30 steps without a flush; the
works held on every rank after step 30 are exactly those held after step 10, below a small
constant, and the weights and losses still equal the local run's bit for bit.

Cost: one 3-process spawn, ~10 s on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

S = 3
STEPS = 30
EARLY = 10
#: pipedream, 2bw (M = 4 >= S), pb in dataflow and 1f1b order
NAMES = ["pipedream", "2bw", "pb", "pb-1f1b"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(S, [("handles", dict(S=S, names=NAMES, steps=STEPS))], timeout=180)


def _get(results: list[dict[str, Any]], rank: int, name: str) -> dict[str, Any]:
    res = results[rank]
    assert res and "fatal" not in res, f"rank {rank}: {res.get('fatal', 'no result')}"
    got = res["handles"][name]
    assert "error" not in got, f"rank {rank}: {got.get('error')}"
    return got


@pytest.mark.parametrize("name", NAMES)
def test_held_sends_do_not_grow_with_steps(results: list[dict[str, Any]], name: str) -> None:
    for r in range(S):
        got = _get(results, r, name)
        held, M = got["held"], got["M"]
        for t, c in enumerate(held):
            # in flight, not every one sent since the last flush (that grows by M a step)
            assert c["grad_sends"] <= M, (r, name, t, c)
            assert c["act_sends"] <= 2 * M, (r, name, t, c)
            assert c["posted"] == 0, (r, name, t, c)
            assert c["loss_sends"] <= S - 1, (r, name, t, c)
        # every step ends at the same point of the streams and releases follow from the
        # schedule alone: the counts are the same after 10 steps as after 30
        assert held[STEPS - 1] == held[EARLY - 1], (r, name, held[EARLY - 1], held[STEPS - 1])
        flushed = got["flushed"]
        assert flushed["act_sends"] == flushed["grad_sends"] == flushed["posted"] == 0, flushed


@pytest.mark.parametrize("name", NAMES)
def test_released_sends_keep_local_equality(results: list[dict[str, Any]], name: str) -> None:
    for r in range(S):
        got = _get(results, r, name)
        assert got["updates"] == got["ref_updates"] > 0, (r, name)
        assert got["weights_equal"], f"rank {r} ({name}): weights differ from the local run"
        assert got["losses_equal"], f"rank {r} ({name}): losses differ from the local run"
