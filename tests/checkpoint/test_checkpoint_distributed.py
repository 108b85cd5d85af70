"""Checkpoint directories under gloo: save at step k / load in a fresh pipeline / continue
equals the uninterrupted run bit for bit (a sync and an async schedule); every refusal is
raised on every rank, names the failing rank and changes nothing; the first rank to fail is
named in its peers' errors. One 2-process spawn (~15 s on 2 cores)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import RANKS, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

NAMES = ["1f1b-adam", "pb-lwp-momentum"]


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="engine-ckpt-")
    kw = dict(S=RANKS, root=root, names=NAMES)
    res = spawn(RANKS, [("checkpoint", kw), ("first_failure", dict(S=RANKS, victim=1))])
    for r, got in enumerate(res):
        assert "fatal" not in got, f"rank {r}: {got.get('fatal')}"
    return res


@pytest.mark.parametrize("name", NAMES)
def test_save_load_continue_equals_uninterrupted(two: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(two):
        got = res["checkpoint"][name]
        assert got["steps_after_load"] == 3
        assert got["changed_by_load"], f"rank {rank}: load did not change the fresh weights"
        assert got["weights_equal"] and got["losses_equal"] and got["optimizer_equal"], (rank, got)
        files = got["files"]
        assert files[0] == "manifest.json" and len(files) == RANKS + 1, files  # + one per rank


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing manifest", ["manifest.json", "does not exist"]),
        ("corrupt rank file", ["rank 1", "SHA-256"]),
        ("missing rank file", ["rank 1", "missing"]),
        ("world layout", ["different world layout", f"world: checkpoint {2 * RANKS} vs this job {RANKS}"]),
        ("failed save", ["saving checkpoint", "rank 1", "disk full"]),
    ],
)
def test_refusals_on_every_rank_change_nothing(two: list[dict[str, Any]], case: str, words: list[str]) -> None:
    for rank, res in enumerate(two):
        msg = res["checkpoint"]["refusals"][case]
        assert msg and not msg.startswith("CHANGED"), (rank, case, msg)
        for w in words:
            assert w in msg, (rank, case, msg)


def test_failed_save_leaves_previous_checkpoint(two: list[dict[str, Any]]) -> None:
    for res in two:
        assert res["checkpoint"]["loads_after_failed_save"]
        assert len(res["checkpoint"]["files_after_failed_save"]) == RANKS + 1  # no stray file


def test_first_failing_rank_is_named_by_its_peers(two: list[dict[str, Any]]) -> None:
    assert two[1]["first_failure"]["type"] == "RuntimeError"
    for rank in (r for r in range(len(two)) if r != 1):  # every survivor, near or far
        got = two[rank]["first_failure"]
        # (a synchronous gloo step: rolled back on every rank, a PeerError naming the cause)
        assert got["type"] == "PeerStepError", (rank, got)
        assert "first rank to fail in this job was rank 1: RuntimeError: boom in the forward" in got["message"]


def test_manifest_tampering_and_foreign_formats_are_refused(tmp_path) -> None:
    import json

    import engine.checkpoint_dir as cd
    from engine import CheckpointError

    body = {"format": cd.DIR_FORMAT, "layout": {"world": 2}, "steps": 3, "ranks": []}
    good = {**body, "sha256": cd._body_sha256(body)}
    (tmp_path / cd.MANIFEST).write_text(json.dumps(good))
    assert cd.read_manifest(tmp_path)["steps"] == 3
    (tmp_path / cd.MANIFEST).write_text(json.dumps({**good, "steps": 4}))  # hand-edited
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        cd.read_manifest(tmp_path)
    (tmp_path / cd.MANIFEST).write_text(json.dumps({**good, "format": "other/9"}))
    with pytest.raises(CheckpointError, match="format 'other/9'"):
        cd.read_manifest(tmp_path)
    (tmp_path / cd.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        cd.read_manifest(tmp_path)
