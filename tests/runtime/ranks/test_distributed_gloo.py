"""Multi-process pipelines over gloo: every schedule and mitigation gives the local run's
weights (and losses) bit for bit with S = 2 and 4 processes, interleaved 1F1B too (2 virtual
stages per process); data-parallel replicas equal one replica with the larger batch; random
sequence lengths (with trees, masks and ties) equal
the local run too; shape disagreements, shapes a stage cannot accept and dead ranks give
clear errors naming the ranks, within the timeout, on every survivor.

Cost: one 2-process and two 4-process spawns (module-scoped fixtures), each running many
configurations; ~40 s in all on 2 cores (the variable-length phases add ~15-25 s on 2 busy
cores).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import configs, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

KILL_TIMEOUT = 8.0
#: asynchronous configurations run with on_nonfinite="skip_update" and NaN losses
SKIP_UPDATE = ["pb", "pb-k2", "pb-lwp", "pb-pipemare-t2", "pb-spectrain-reuse", "pipedream", "2bw"]
SKIP_UPDATE_DP = ["pb", "2bw"]
STALL_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return spawn(
        2,
        [
            ("equal", dict(S=2, names=None)),
            ("balance", dict(S=2)),
            ("handshake_mismatch", dict(S=2)),
            ("varlen", dict(S=2, names=["gpipe-tied", "1f1b-tied", "pipedream", "pb"])),
            ("varlen_mixed", dict(S=2, names=["1f1b-tied", "pb"])),
            ("interleaved", dict(R=2)),
            ("reject_input", dict(S=2)),
            ("skip_update", dict(S=2, names=[*SKIP_UPDATE, "first-pb"])),
            ("reject_later", dict(S=2)),  # terminal: the last stage stops mid-step
        ],
    )


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return spawn(
        4,
        [
            ("equal", dict(S=4, names=None)),
            ("varlen", dict(S=4, names=["1f1b-tied", "pb"])),
            ("varlen_mixed", dict(S=4, names=["pipedream"])),
            ("interleaved", dict(R=4)),
            ("skip_update", dict(S=4, names=SKIP_UPDATE)),
            ("kill", dict(S=4, victim=2, timeout=KILL_TIMEOUT)),  # terminal
        ],
    )


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return spawn(
        4,
        [
            ("data_parallel", dict(S=2, R=2)),
            ("skip_update", dict(S=2, R=2, names=SKIP_UPDATE_DP)),
            ("stall", dict(S=4, victim=1, timeout=STALL_TIMEOUT)),  # terminal
        ],
    )


def _check_equal(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res["equal"][name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["updates"] == got["ref_updates"] > 0
        assert got["delays"] == got["ref_delays"]
        assert got["leftovers"] == 0, f"rank {rank} ({name}): state left after flush"
        assert got["weights_equal"], f"rank {rank} ({name}): max |diff| {got['max_diff']}"
        assert got["losses_equal"], f"rank {rank} ({name}): losses differ from the local run"


@pytest.mark.parametrize("name", sorted(configs(2)))
def test_gloo_two_ranks_bitwise_equal_local(two: list[dict[str, Any]], name: str) -> None:
    _check_equal(two, name)


@pytest.mark.parametrize("name", sorted(configs(4)))
def test_gloo_four_ranks_bitwise_equal_local(four: list[dict[str, Any]], name: str) -> None:
    _check_equal(four, name)


def test_automatic_balance_is_decided_once_and_shared(two: list[dict[str, Any]]) -> None:
    got = [res["balance"] for res in two]
    assert all("error" not in g for g in got), got
    assert got[0]["balance"] == got[1]["balance"]
    assert sum(got[0]["balance"]) == 7 and len(got[0]["balance"]) == 2
    assert all(g["equal"] and g["losses_equal"] for g in got), got


def test_handshake_mismatch_names_both_ranks_on_every_rank(two: list[dict[str, Any]]) -> None:
    for res in two:
        got = res["handshake_mismatch"]
        assert got["type"] == "PipelineInputError", got
        msg = got["message"]
        assert "stage 0 (rank 0) outputs shape (2, 6)" in msg, msg
        assert "stage 1 (rank 1)" in msg and "in_features=7" in msg, msg
        assert got["unchanged"]


@pytest.mark.parametrize("phase", ["varlen", "varlen_mixed"])
@pytest.mark.parametrize("world", [2, 4])
def test_variable_lengths_equal_local_bit_for_bit(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int, phase: str
) -> None:
    """Random sequence lengths per step and per micro-batch, dict activations with a bool
    mask and a constant, a weight tied between the first and the last stage (synchronous
    schedules); a new Signature travels exactly when the length changes. varlen_mixed: the
    activation header moves between inside the first leaf's message and a message of its own
    as the length changes (transport/framing.py)."""
    results = two if world == 2 else four
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = dict(res[phase])
        expected = got.pop("expected_changes")
        assert expected > 4
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["weights_equal"] and r["losses_equal"], (rank, name, r)
            assert r["updates"] > 0 and r["leftovers"] == 0, (rank, name, r)
            assert r["ties"] == (1 if name.endswith("tied") else 0), (rank, name, r)
            assert r["shape_changes"] == (expected if rank < world - 1 else 0), (rank, name, r)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_equals_local_bit_for_bit(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int
) -> None:
    """Interleaved 1F1B with v=2 virtual stages per rank (rank r holds r and r+R): the
    weights of every stage a rank holds and the losses equal the local run's after 2 steps,
    on an MLP and on dict activations with a mask, variable lengths and a tied weight;
    nothing stays held; evaluate() gives the local outputs; a state_dict of the v stages
    resumes exactly; an input stage 0 cannot take stops every rank before the step and the
    next step runs as the local one; replicas of a one-rank pipeline are refused before any weight is
    touched (data parallelism itself: test_data_parallel_equals_one_replica_with_larger_batch)."""
    results = two if world == 2 else four
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res["interleaved"]
        for name in ("mlp", "varlen-tied"):
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == [rank, rank + world], (rank, name, r)
            assert r["weights_equal"] and r["losses_equal"], (rank, name, r)
            assert r["updates"] == [2, 2] and r["leftovers"] == 0, (rank, name, r)
            assert r["ties"] == (1 if name.endswith("tied") else 0), (rank, name, r)
        assert got["mlp"]["resumed_equal"] and got["mlp"]["evaluate_equal"], got["mlp"]
        reject = got["reject"]  # the error went round the v stages and left nothing in flight
        assert reject.get("type") == "PipelineInputError", reject
        assert "stage 0 (rank 0) cannot accept it" in reject["message"], reject
        assert reject["seconds"] < 10 and reject["unchanged"] and reject["then_equal"], reject
        refused = got["refused"]
        assert "puts all 2 stages on one rank" in refused.get("message", ""), refused
        assert f"data_parallel={world}" in refused["message"], refused
        assert "virtual_stages=2" in refused["message"] and refused["unchanged"], refused


def test_input_shape_a_stage_cannot_accept_stops_every_rank_before_the_step(
    two: list[dict[str, Any]],
) -> None:
    for rank in range(2):
        got = two[rank]["reject_input"]
        assert got["type"] == "PipelineInputError", got
        msg = got["message"]
        assert "stage 0 (rank 0) cannot accept it" in msg and "(2, 4, 6) -> (2, 4, 7)" in msg, msg
        assert "in_features=6" in msg, msg
        assert got["unchanged"] and got["updates"] == 1, got


def test_later_shape_a_stage_cannot_accept_is_a_clear_error(two: list[dict[str, Any]]) -> None:
    receiver = two[1]["reject_later"]
    assert receiver["type"] == "PipelineInputError", receiver
    msg = receiver["message"]
    assert "the output of stage 0 (rank 0) changed at micro-batch 4" in msg, msg
    assert "(2, 4, 6) -> (2, 5, 6)" in msg and "stage 1 (rank 1) cannot accept it" in msg, msg
    assert "in_features=24" in msg, msg
    sender = two[0]["reject_later"]
    assert sender["type"] == "PeerError" and "stage 1 (rank 1)" in sender["message"], sender
    assert sender["seconds"] < 4 + 5
    for got in (receiver, sender):  # a synchronous step: no rank updated anything
        assert got["unchanged"] and got["updates"] == 1, got


def test_killed_rank_makes_every_survivor_fail_in_time(four: list[dict[str, Any]]) -> None:
    victim = 2
    assert "kill" not in four[victim] or four[victim]["kill"]["type"] is None  # it never reported
    for rank in (0, 1, 3):
        got = four[rank]["kill"]
        assert got["type"] == "PeerError", (rank, got)
        assert got["seconds"] < KILL_TIMEOUT + 5, (rank, got)
        assert "failed: the connection broke" in got["message"], got["message"]
        assert "The peer rank most likely died" in got["message"]
        if abs(rank - victim) == 1:  # direct neighbours name the dead rank itself
            assert f"stage {victim} (rank {victim})" in got["message"], got["message"]


def test_stalled_rank_makes_its_neighbours_time_out(grid: list[dict[str, Any]]) -> None:
    victim = 1
    assert grid[victim]["stall"]["type"] == "slept"
    for rank in (0, 2):  # the stalled rank's neighbours wait for it, then give up in time
        got = grid[rank]["stall"]
        assert got["type"] == "PeerError", (rank, got)
        assert (
            f"with stage {victim} (rank {victim}) failed: no answer within timeout=4s"
            in got["message"]
        ), got["message"]
        assert STALL_TIMEOUT - 0.5 < got["seconds"] < STALL_TIMEOUT + 5, (rank, got)
    assert grid[3]["stall"]["type"] == "PeerError"  # its neighbour gave up and left


@pytest.mark.parametrize("name", ["gpipe", "pipedream", "interleaved"])
def test_data_parallel_equals_one_replica_with_larger_batch(
    grid: list[dict[str, Any]], name: str
) -> None:
    for rank, res in enumerate(grid):
        assert "fatal" not in res, res.get("fatal")
        got = res["data_parallel"][name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["replica"] == rank // 2
        assert got["stages"] == ([rank % 2, rank % 2 + 2] if name == "interleaved" else [rank % 2])
        assert got["moved"] > 1e-3  # training changed the weights
        assert got["max_diff"] < 1e-5, (rank, got)
        assert got["loss_diff"] < 1e-5, (rank, got)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", SKIP_UPDATE)
def test_skip_update_flags_travel_with_the_gradients(
    two: list[dict[str, Any]], four: list[dict[str, Any]], world: int, name: str
) -> None:
    """on_nonfinite="skip_update" under gloo: each NaN loss's device flag reaches every
    earlier rank with its gradient, so every rank skips exactly the updates the local run
    skips (bitwise equal weights, NaN losses where it has them, the same device counters)."""
    _check_skip_update(two if world == 2 else four, "skip_update", name)


def test_skip_update_flag_travels_alone(two: list[dict[str, Any]]) -> None:
    """pb with a parameterless stage 0: no leaf carries a gradient back to it, so the flag is
    the whole message (and the ranks still agree on what travels)."""
    _check_skip_update(two, "skip_update", "first-pb")


def _check_skip_update(results: list[dict[str, Any]], phase: str, name: str) -> None:
    world = len(results)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res[phase][name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["weights_equal"], f"rank {rank} ({name}): max |diff| {got['max_diff']}"
        assert got["finite"] and got["found_inf_clear"], (rank, got)
        assert got["losses_equal"] and got["nan_losses"] == got["ref_nan_losses"], (rank, got)
        assert any(got["nan_losses"])
        if got["params"]:  # (a parameterless stage has no update to skip)
            assert got["updates"] == got["ref_updates"]
            assert got["skipped"] == got["ref_skipped"] > 0, (rank, got)
        # the non-finite losses are counted where they were computed: the last stage
        assert got["dropped"] == (got["ref_dropped"] if rank == world - 1 else 0), (rank, got)


@pytest.mark.parametrize("name", SKIP_UPDATE_DP)
def test_skip_update_replicas_skip_the_same_updates(grid: list[dict[str, Any]], name: str) -> None:
    """2 replicas x 2 stages, a NaN that reaches replica 0 only: the flag is averaged with
    the gradients, so both replicas skip (else replica 1 would apply the NaN mean) and equal
    one replica with the larger batch."""
    for rank, res in enumerate(grid):
        assert "fatal" not in res, res.get("fatal")
        got = res["skip_update"][name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["finite"], (rank, got)
        assert got["max_diff"] < 1e-5 and got["loss_diff"] < 1e-5, (rank, got)
        assert got["nan_losses"] == got["ref_nan_losses"] and any(got["nan_losses"])
        assert got["skipped"] == got["ref_skipped"] > 0, (rank, got)
