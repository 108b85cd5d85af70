"""NCCL between processes, one GPU per rank: the multi-process test phases of
tests/distributed_support.py (the ones the gloo and NCCL-twin tests run) on real NCCL, at 2
ranks and at 4, compared with the local run of the same configuration on the same GPU.

What runs: every schedule and mitigation (``configs``); shapes that change between steps
(shape notices, ``activation_shapes="inputs"``) and between micro-batches
(``activation_shapes="any"``), with trees, masks and a tied weight; dict activations;
``on_nonfinite="skip_update"`` (the flags travel with the gradients on the device), 2 replicas
x 2 stages too; a handshake mismatch; and, last, a rank that dies (its peers must raise
PeerError in time, not hang). On a GPU the local run and the pipeline compute each
micro-batch with the same kernels, but not every kernel is deterministic, so values are
compared within ``TOL``, not bit for bit.

Needs 2 GPUs (4 for the ``ranks4`` tests): marked ``cuda`` and ``distributed``, skipped
elsewhere. .ci/gpu's ``nccl`` phase runs ``-k ranks2``, then ``-k ranks4``, each one spawn.
``ENGINE_NCCL_TEST_TWIN=1`` runs the same spawns over the NCCL twin on a CPU machine (then
bit for bit), which checks this file's phases and assertions before a GPU machine does.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from distributed_support import configs, spawn

#: over the NCCL twin on the CPU instead of real NCCL (module docstring)
TWIN = os.environ.get("ENGINE_NCCL_TEST_TWIN", "").strip() == "1"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: largest |pipeline - local| of a weight or a loss on a GPU
TOL = 1e-5
KILL_TIMEOUT = 8.0
#: asynchronous configurations run with on_nonfinite="skip_update" and NaN losses
SKIP_UPDATE = ["pb", "pb-k2", "pb-lwp", "pb-pipemare-t2", "pb-spectrain-reuse", "pipedream", "2bw"]
SKIP_UPDATE_DP = ["pb", "2bw"]
#: phases a second time in one spawn, under another name (results are keyed by name)
ANY_SHAPES = "distributed_support.phase_varlen"
REPLICAS_SKIP = "distributed_support.phase_skip_update"

pytestmark = [pytest.mark.distributed] + ([] if TWIN else [pytest.mark.cuda])


def needs(world: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not TWIN and GPUS < world,
        reason=f"NCCL allows one rank per GPU: {world} ranks need {world} GPUs, {GPUS} visible",
    )


#: what each spawn runs, in order (the rank that dies comes last)
PHASES: dict[str, tuple[int, list[tuple[str, dict[str, Any]]]]] = {
    "ranks2": (2, [
        ("equal", dict(S=2, names=None)),
        ("varlen", dict(S=2, names=["gpipe-tied", "1f1b-tied", "pipedream", "pb"], trim=False)),
        (ANY_SHAPES, dict(S=2, names=["1f1b-tied", "pb"], activation_shapes="any")),
        ("trees", dict(S=2)),
        ("skip_update", dict(S=2, names=[*SKIP_UPDATE, "first-pb"])),
        ("handshake_mismatch", dict(S=2)),
    ]),
    "ranks4": (4, [
        ("equal", dict(S=4, names=None)),
        ("varlen", dict(S=4, names=["1f1b-tied", "pb"], trim=False)),
        ("skip_update", dict(S=4, names=SKIP_UPDATE)),
        ("data_parallel", dict(S=2, R=2)),
        (REPLICAS_SKIP, dict(S=2, R=2, names=SKIP_UPDATE_DP)),
        ("kill", dict(S=4, victim=2, timeout=KILL_TIMEOUT)),  # terminal
    ]),
}
#: seconds per spawn, inside .ci/gpu's step budgets (130 s each, pytest's start included)
SPAWN_TIMEOUT = {"ranks2": 115, "ranks4": 115}
BOTH = [pytest.param("ranks2", marks=needs(2)), pytest.param("ranks4", marks=needs(4))]


@pytest.fixture(scope="module")
def spawned(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    world, phases = PHASES[request.param]
    return spawn(world, phases, timeout=SPAWN_TIMEOUT[request.param] * (3 if TWIN else 1),
                 transport="nccl", twin=TWIN)


def results(spawned: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    """Every rank's results of ``phase`` (a missing one says what the rank reported)."""
    out = []
    for rank, res in enumerate(spawned):
        assert "fatal" not in res, f"rank {rank}: {res['fatal']}"
        assert phase in res, (f"rank {rank} never finished phase {phase!r} (the spawn's "
                              f"timeout, or a crash); it finished {sorted(res)}")
        out.append(res[phase])
    return out


def same(got: dict[str, Any], what: str) -> None:
    """Equal to the local run: bit for bit on the twin, within TOL on a GPU."""
    if TWIN:
        assert got["weights_equal"] and got["losses_equal"], (what, got)
    else:
        assert got["max_diff"] < TOL, (what, got)
        if "loss_diff" in got:
            assert got["loss_diff"] < TOL, (what, got)


@pytest.mark.parametrize("spawned", BOTH, indirect=True)
def test_every_configuration_matches_the_local_run(spawned: list[dict[str, Any]]) -> None:
    world = len(spawned)
    for rank, got in enumerate(results(spawned, "equal")):
        for name in configs(world):
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["updates"] == r["ref_updates"] > 0, (rank, name, r)
            assert r["delays"] == r["ref_delays"], (rank, name, r)
            assert r["leftovers"] == 0, f"rank {rank} ({name}): state left after flush"
            same(r, f"rank {rank} {name}")


@pytest.mark.parametrize("spawned", BOTH, indirect=True)
def test_shapes_that_change_between_steps_travel_with_notices(spawned: list[dict[str, Any]]) -> None:
    """Sequence lengths that change between steps only (so they follow from the input's
    shapes): a new Signature travels on the control plane exactly when they change, the
    activations in between without a header."""
    world = len(spawned)
    for rank, got in enumerate(results(spawned, "varlen")):
        got = dict(got)
        expected = got.pop("expected_changes")
        assert expected > 0
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            same(r, f"rank {rank} {name}")
            assert r["updates"] > 0 and r["leftovers"] == 0, (rank, name, r)
            assert r["ties"] == (1 if name.endswith("tied") else 0), (rank, name, r)
            assert r["shape_changes"] == (expected if rank < world - 1 else 0), (rank, name, r)
            assert r["notices"] and r["notices"] > 0, (rank, name, r)


@pytest.mark.parametrize("spawned", [BOTH[0]], indirect=True)
def test_shapes_that_depend_on_the_data_travel_with_a_header_each(
    spawned: list[dict[str, Any]],
) -> None:
    """activation_shapes="any": lengths trimmed by the data, per micro-batch."""
    for rank, got in enumerate(results(spawned, ANY_SHAPES)):
        got = dict(got)
        expected = got.pop("expected_changes")
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            same(r, f"rank {rank} {name}")
            assert r["leftovers"] == 0, (rank, name, r)
            assert r["shape_changes"] == (expected if rank < len(spawned) - 1 else 0), (rank, name, r)


@pytest.mark.parametrize("spawned", [BOTH[0]], indirect=True)
def test_dict_activations_match_the_local_run(spawned: list[dict[str, Any]]) -> None:
    """Dicts of tensors between the stages (a bool mask, int ids, a float without gradient,
    a constant)."""
    for rank, got in enumerate(results(spawned, "trees")):
        for name, r in got.items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            same(r, f"rank {rank} {name}")
            assert r["updates"] == r["ref_updates"] > 0 and r["leftovers"] == 0, (rank, name, r)


def _check_skip_update(spawned: list[dict[str, Any]], phase: str, names: list[str]) -> None:
    for rank, got in enumerate(results(spawned, phase)):
        for name in names:
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["finite"] and r["found_inf_clear"], (rank, name, r)
            assert r["max_diff"] < TOL and (not TWIN or r["weights_equal"]), (rank, name, r)
            assert r["nan_losses"] == r["ref_nan_losses"] and any(r["nan_losses"]), (rank, name, r)
            if r["params"]:  # (a parameterless stage has no update to skip)
                assert r["updates"] == r["ref_updates"], (rank, name, r)
                assert r["skipped"] == r["ref_skipped"] > 0, (rank, name, r)


@pytest.mark.parametrize("spawned", BOTH, indirect=True)
def test_skip_update_flags_travel_on_the_device(spawned: list[dict[str, Any]]) -> None:
    """on_nonfinite="skip_update": the flags ride with the gradients (device tensors, no
    host read); every rank skips the updates the local run skips."""
    _check_skip_update(spawned, "skip_update", SKIP_UPDATE)


@pytest.mark.parametrize("spawned", [BOTH[0]], indirect=True)
def test_skip_update_flag_travels_alone(spawned: list[dict[str, Any]]) -> None:
    """pb with a parameterless stage 0: no leaf carries a gradient back to it, so the flag
    is the whole message (also at an asynchronous step's end, where it is received early)."""
    _check_skip_update(spawned, "skip_update", ["first-pb"])


@pytest.mark.parametrize("spawned", [BOTH[0]], indirect=True)
def test_handshake_mismatch_names_both_ranks(spawned: list[dict[str, Any]]) -> None:
    for got in results(spawned, "handshake_mismatch"):
        assert got.get("type") == "PipelineInputError", got
        assert "stage 0 (rank 0) outputs shape (2, 6)" in got["message"], got["message"]
        assert "stage 1 (rank 1)" in got["message"] and "in_features=7" in got["message"]
        assert got["unchanged"]


@pytest.mark.parametrize("spawned", [BOTH[1]], indirect=True)
@pytest.mark.parametrize("name", ["gpipe", "pipedream", "interleaved"])
def test_data_parallel_equals_one_replica_with_a_larger_batch(
    spawned: list[dict[str, Any]], name: str
) -> None:
    """2 replicas x 2 stages on 4 GPUs (the gradient all-reduce on NCCL) vs one replica with
    the larger batch."""
    for rank, got in enumerate(results(spawned, "data_parallel")):
        r = got[name]
        assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
        assert r["replica"] == rank // 2 and r["moved"] > 1e-3, (rank, name, r)
        assert r["max_diff"] < TOL and r["loss_diff"] < TOL, (rank, name, r)


@pytest.mark.parametrize("spawned", [BOTH[1]], indirect=True)
@pytest.mark.parametrize("name", SKIP_UPDATE_DP)
def test_skip_update_replicas_skip_the_same_updates(spawned: list[dict[str, Any]], name: str) -> None:
    for rank, got in enumerate(results(spawned, REPLICAS_SKIP)):
        r = got[name]
        assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
        assert r["finite"] and r["max_diff"] < TOL and r["loss_diff"] < TOL, (rank, name, r)
        assert r["nan_losses"] == r["ref_nan_losses"] and any(r["nan_losses"]), (rank, name, r)
        assert r["skipped"] == r["ref_skipped"] > 0, (rank, name, r)


@pytest.mark.parametrize("spawned", [BOTH[1]], indirect=True)
def test_a_dead_rank_makes_every_survivor_raise_in_time(spawned: list[dict[str, Any]]) -> None:
    """Rank 2 exits abruptly in the third step of pb: the others raise PeerError within the
    timeout (and some slack), naming a peer, instead of waiting on the device forever."""
    victim = 2
    for rank in (0, 1, 3):
        res = spawned[rank]
        assert "kill" in res, (f"rank {rank} never reported the dead rank (hung until the "
                               f"spawn's timeout, or its process was ended); it finished "
                               f"{sorted(res)}")
        got = res["kill"]
        assert got["type"] == "PeerError", (rank, got)
        assert got["seconds"] < KILL_TIMEOUT + 5, (rank, got)
        assert "The peer rank most likely died" in got["message"], got["message"]
    assert "kill" not in spawned[victim] or spawned[victim]["kill"]["type"] is None
