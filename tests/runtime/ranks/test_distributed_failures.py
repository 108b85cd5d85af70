"""The step protocol's exception guarantees under gloo (2 and 4 ranks; synchronous gpipe and
1F1B, asynchronous pb and PipeDream), each against the local run doing the same recovery:

* a Ctrl-C on every rank, or on one, during a step: deferred to the end of the step on that
  rank, which raises KeyboardInterrupt after it; every rank stays in step, engine.save works,
  and the run continues to the local run's weights bit for bit;
* a non-finite loss with on_nonfinite="raise" (synchronous): every rank rolls the step back,
  pipe.steps as locally;
* an optimizer that raises on one rank in the update phase: that stage skips its update, the
  others update, as locally;
* an exception inside a user stage's forward or backward in a synchronous step: the failing
  rank sends abort frames for what it still owes, every rank rolls the step back; the failing
  rank raises the user's error, every other rank a PeerStepError; the step is retried and the
  run continues to the local run's weights (the same exception, rolled back, retried) bit for
  bit; also in the first stage's last backward, once every other rank's lane has ended;
* the same in an asynchronous step: the failing rank drops that micro-batch as the local run
  does, tells its peers with dropped frames, finishes the step and raises the user's error;
  the others go on; after a forward's failure the weights are the local run's bit for bit
  (after a backward's, the local run also drops the other stages' backwards that shared its
  one autograd call, which ranks do not share: consistent, not equal);
* with data-parallel replicas (no frames across replicas) the failing rank raises the user's
  error with a note, every other rank a PeerError naming it (terminal: the run restarts from a
  checkpoint).

Cost: two spawns (2 and 4 processes), ~1-3 min on 2 busy cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

NAMES = ["gpipe", "1f1b-adam", "pb", "pipedream"]
SYNC = {"gpipe", "1f1b-adam"}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return spawn(2, [
        ("failure_dist_support:recover", dict(S=2, names=NAMES)),
        ("failure_dist_support:stage_recover", dict(
            S=2, names=["gpipe", "1f1b-adam"],
            cases=[[0, "forward"], [1, "backward"], [0, "last-backward"]],
        )),
        ("failure_dist_support:async_drop", dict(
            S=2, names=["pb", "pipedream"], cases=[[0, "forward"], [1, "backward"]]
        )),
    ], timeout=480)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return spawn(4, [
        ("failure_dist_support:recover", dict(S=4, names=["1f1b-adam", "pb"])),
        ("failure_dist_support:stage_recover", dict(
            S=4, names=["1f1b-adam", "gpipe"],
            cases=[[2, "backward"], [1, "forward"], [0, "last-backward"]],
        )),
        ("failure_dist_support:async_drop", dict(
            S=4, names=["pb", "pipedream"], cases=[[2, "backward"], [1, "forward"]]
        )),
        # terminal (messages are left in flight), last: with data-parallel replicas a stage
        # that raises still stops its rank (no abort frames across replicas)
        ("failure_dist_support:stage_error", dict(S=2, R=2, victim=2, where="backward", name="pb")),
    ], timeout=480)


def _check_recover(results: list[dict[str, Any]], S: int) -> None:
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for key, got in res["failure_dist_support:recover"].items():
            assert "error" not in got, (rank, key, got["error"])
            name, case = key.split("/")
            where = (rank, key, got)
            assert got["weights_equal"], where
            if name in SYNC:  # (an asynchronous local step paused by a Ctrl-C is not counted)
                assert got["steps"] == got["ref_steps"], where
            else:
                assert got["steps"] == 5, where  # every step() call fed its batch
            victim = S - 1 if case == "sigint-one" else 1
            raises = case in ("sigint-all", "nonfinite") or rank == victim
            if not raises:
                assert got["raised"] is None, where
                continue
            assert got["raised"] is not None and got["raised"][0] == 2, where
            _, kind, _, notes = got["raised"]
            if case.startswith("sigint"):
                assert kind == "KeyboardInterrupt" and "the step completed" in notes, where
                assert got["steps_after"] == 3, where  # the step ran to its end
            elif case == "nonfinite":
                assert kind == "NonFiniteLossError", where
                assert got["steps_after"] == 2, where  # rolled back: not counted, as locally
            else:
                assert kind == "RuntimeError" and "update was skipped" in notes, where


def _check_stage_error(results: list[dict[str, Any]], victim: int, where: str) -> None:
    quoted = 0
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res["failure_dist_support:stage_error"]
        if rank == victim:
            assert got["type"] == "ValueError" and f"user's {where}" in got["message"], got
            assert "this rank stopped in the middle of the step" in got["notes"], got
            assert "consistent" not in got["notes"], got  # it is not: no such promise
        else:
            assert got["type"] == "PeerError" and "(rank " in got["message"], (rank, got)
            quoted += f"first rank to fail in this job was rank {victim}: ValueError" in got["message"]
    # a rank whose wait timed out before the victim's note reached the store names only the
    # neighbour it waited for (first_failure.py is best effort); most quote the victim
    assert quoted >= 1, results


def _check_stage_recover(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for key, got in res["failure_dist_support:stage_recover"].items():
            assert "error" not in got, (rank, key, got["error"])
            name, victim, where = key.split("/")
            at = (rank, key, got)
            assert got["raised"] is not None, at  # every rank raised at the failing step
            kind, message, notes = got["raised"]
            if rank == int(victim):
                said = "backward" if where == "last-backward" else where
                assert kind == "ValueError" and f"user's {said}" in message, at
            else:
                assert kind == "PeerStepError" and "another rank's stage raised" in message, at
            assert "the step was rolled back" in notes and "consistent" in notes, at
            assert got["steps_before"] == 2 and got["steps"] == got["ref_steps"] == 5, at
            assert got["weights_equal"], at


def _check_async_drop(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for key, got in res["failure_dist_support:async_drop"].items():
            assert "error" not in got, (rank, key, got["error"])
            name, victim, where = key.split("/")
            at = (rank, key, got)
            if rank == int(victim):
                kind, message, notes = got["raised"]
                assert kind == "ValueError" and f"user's {where}" in message, at
                assert "dropped" in notes and "consistent" in notes, at
            else:
                assert got["raised"] is None, at  # told by dropped frames, it went on
            assert got["steps"] == 5, at  # every step() ran to its end on every rank
            if where == "forward":  # dropped at every stage, as locally: the same weights
                assert got["dropped"] == got["ref_dropped"] == 1 and got["weights_equal"], at
            else:  # (locally the backwards batched into the failing autograd call drop too)
                assert got["dropped"] <= 1 and got["ref_dropped"] >= 1, at


def test_recovery_two_ranks(two: list[dict[str, Any]]) -> None:
    _check_recover(two, 2)


def test_recovery_four_ranks(four: list[dict[str, Any]]) -> None:
    _check_recover(four, 4)


def test_stage_error_with_replicas_stops_the_rank(four: list[dict[str, Any]]) -> None:
    _check_stage_error(four, 2, "backward")


def test_stage_error_recovers_two_ranks(two: list[dict[str, Any]]) -> None:
    _check_stage_recover(two)


def test_stage_error_recovers_four_ranks(four: list[dict[str, Any]]) -> None:
    _check_stage_recover(four)


def test_async_stage_error_drops_as_locally_two_ranks(two: list[dict[str, Any]]) -> None:
    _check_async_drop(two)


def test_async_stage_error_drops_as_locally_four_ranks(four: list[dict[str, Any]]) -> None:
    _check_async_drop(four)
