"""Checkpoints of data-parallel pipelines hold each weight and optimizer shard once (issue 27,
item 3): replica 0 of each (stage, tp rank) writes them, every other replica only its own
part (buffers such as BatchNorm statistics, scheduler, counters, RNG, micro-batches in
flight). Save + load + continue equals the uninterrupted run bit for bit (flushed and
unflushed), the files hold every parameter and optimizer tensor once, an old-format
directory (every replica wrote everything) still loads, and a corrupted or missing writer
file is refused on every rank naming the file and the rank.

Cost (2 cores): 2 stages x 2 replicas, one 4-process spawn (~20 s); TP=2 x PP=2 x DP=2
(8 processes) is ``slow``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import spawn

from engine.serialization import read_state

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

PHASE = "dp_checkpoint_support.phase_dp_checkpoint"


def _run(root: str, world: int, **kw: Any) -> list[dict[str, Any]]:
    res = spawn(world, [(PHASE, dict(root=root, **kw))], timeout=500)
    for r, got in enumerate(res):
        assert got and "fatal" not in got, f"rank {r}: {got.get('fatal')}"
    return [got[PHASE] for got in res]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("dp-ckpt"))
    return root, _run(root, 4, R=2)


def _check_resume(results: list[dict[str, Any]], names: tuple[str, ...], unflushed: tuple[str, ...]) -> None:
    for rank, res in enumerate(results):
        for name in (*names, *unflushed):
            got = res[name]
            assert "error" not in got, f"rank {rank} {name}: {got['error']}"
            for label in ("new", "old") if name in names else ("new",):
                assert all(got[label].values()), (rank, name, label, got[label])
    flushed = max(res[name]["in_flight"] for res in results for name in names)
    for name in unflushed:  # more tensors in flight than a flushed state (the last stage may hold none)
        assert any(res[name]["in_flight"] > flushed for res in results), name


def _count(path: str) -> dict[str, Any]:
    """Per file of directory ``path``: which module parameters, buffers and optimizer tensors
    of which stage it holds, and its size."""
    with open(os.path.join(path, "manifest.json")) as f:
        man = json.load(f)
    out = {"manifest": man, "files": {}}
    for e in man["ranks"]:
        file = os.path.join(path, e["file"])
        state = read_state(file)
        held = []
        for sd in state["stages"]:
            for key in sd["module"]:
                held.append(("module", sd["index"], e.get("tp_rank", 0), key))
            opt = sd.get("optimizer") or {}
            for p, tensors in opt.get("state", {}).items():
                for key in tensors:
                    held.append(("optimizer", sd["index"], e.get("tp_rank", 0), f"{p}.{key}"))
        out["files"][e["rank"]] = {"held": held, "bytes": os.path.getsize(file), "entry": e}
    return out


def _check_once(path: str, replicas: int) -> None:
    c = _count(path)
    assert c["manifest"]["format"] == "engine.checkpoint-dir/2"
    seen: dict[tuple[Any, ...], int] = {}
    for rank, f in c["files"].items():
        for item in f["held"]:
            seen[item] = seen.get(item, 0) + 1
        e = f["entry"]
        assert e["holds"] == ("all" if e["replica"] == 0 else "own"), e
        if e["replica"]:
            writer = c["files"][e["shared_from"]]["entry"]
            assert (writer["stage"], writer["replica"], writer.get("tp_rank")) == (
                e["stage"], 0, e.get("tp_rank")), (e, writer)
            assert f["bytes"] < c["files"][e["shared_from"]]["bytes"], (rank, f["bytes"])
    params = {i for i in seen if i[0] == "optimizer" or not i[3].endswith(
        ("running_mean", "running_var", "num_batches_tracked"))}
    assert params and any(i[0] == "optimizer" for i in params)
    for item in params:  # every parameter and optimizer tensor: in exactly one file
        assert seen[item] == 1, (item, seen[item])
    for item in set(seen) - params:  # a buffer: in every replica's own file
        assert seen[item] == replicas, (item, seen[item])


def test_two_stages_two_replicas_resume_bitwise(plain: tuple[str, list[dict[str, Any]]]) -> None:
    _check_resume(plain[1], ("1f1b-adam",), ("pipedream",))


def test_replicas_hold_different_batchnorm_statistics(plain: tuple[str, list[dict[str, Any]]]) -> None:
    """The premise of keeping buffers per replica: stage 0's running statistics differ."""
    import torch

    r0, r1 = plain[1][0]["1f1b-adam"]["saved"], plain[1][2]["1f1b-adam"]["saved"]  # stage 0
    assert not all(torch.equal(a, b) for a, b in zip(r0, r1, strict=True))


@pytest.mark.parametrize("name", ["1f1b-adam", "pipedream"])
def test_each_shard_is_written_once(plain: tuple[str, list[dict[str, Any]]], name: str) -> None:
    _check_once(os.path.join(plain[0], name), replicas=2)


def test_old_format_files_hold_everything_per_replica(plain: tuple[str, list[dict[str, Any]]]) -> None:
    c = _count(os.path.join(plain[0], "1f1b-adam-v1"))
    assert c["manifest"]["format"] == "engine.checkpoint-dir/1"
    new = _count(os.path.join(plain[0], "1f1b-adam"))
    for rank in c["files"]:
        assert len(c["files"][rank]["held"]) == len(c["files"][rank % 2]["held"])
        assert sum(f["bytes"] for f in c["files"].values()) > sum(f["bytes"] for f in new["files"].values())


def test_corrupt_or_missing_writer_file_is_refused(plain: tuple[str, list[dict[str, Any]]]) -> None:
    for rank, res in enumerate(plain[1]):
        got = res["refusals"]
        victim, reader, file = got["victim"], got["reader"], os.path.basename(got["file"])
        assert (victim, reader) == (1, 3)
        for case, word in (("corrupt", "SHA-256"), ("missing", "missing")):
            msg = got[case]
            assert msg and not msg.startswith("CHANGED"), (rank, case, msg)
            assert f"rank {victim}" in msg and file in msg and word in msg, (rank, case, msg)
            if rank == reader:
                says = got[f"{case}_reader"]
                assert f"rank {victim}'s file" in says and f"rank {reader}'s" in says, says
                assert file in says and word in says, says
        assert got["restored_loads"], rank


@pytest.mark.slow
def test_tp2_pp2_dp2_each_shard_once_and_bitwise(tmp_path: Any) -> None:
    results = _run(str(tmp_path), 8, R=2, shape=(2, 2, 2))
    _check_resume(results, ("1f1b-adam",), ("pipedream",))
    for name in ("1f1b-adam", "pipedream"):
        _check_once(os.path.join(str(tmp_path), name), replicas=2)
    for res in results:
        got = res["refusals"]
        for case in ("corrupt", "missing"):
            assert f"rank {got['victim']}" in got[case] and os.path.basename(got["file"]) in got[case]
        assert got["restored_loads"]
        assert "build the mesh with the same dimension order" in res["other_order"], res["other_order"]
