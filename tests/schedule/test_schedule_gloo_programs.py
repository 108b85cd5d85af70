"""Rank programs under gloo (2 and 4 processes) train bit for bit like the local run (which
equals the unpipelined model, test_schedule_vshape_runtime): looped BFS, the V placement of zbv
and dualpipev (rank r holds stages r and 2R-1-r: the first and the last stage on rank 0, stages
R-1 and R handed over within rank R-1), contiguous blocks (any placement map; also reversed, so
the inputs enter on the last rank and the loss comes from rank 0), and the CSVs that
torch 2.13's ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble and ScheduleLoopedBFS dump; with trees, masks and a tied weight;
with data-parallel replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_support import spawn
from test_schedule_tdp_csv import CLASSES, torch_schedule

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _v(rank: int, R: int) -> list[int]:
    return sorted((rank, 2 * R - 1 - rank))


@pytest.mark.parametrize("R", [2, 4])
def test_rank_programs_under_gloo(R: int, tmp_path: Path) -> None:
    csvs = {}
    for kind in CLASSES:
        path = tmp_path / f"{kind}.csv"
        torch_schedule(kind, R, 2 * R)._dump_csv(str(path), format="compute_comms")
        csvs[f"torch_{kind}"] = path.read_text()
    results = spawn(R, [("rank_programs", dict(R=R, csvs=csvs))], timeout=400)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res["rank_programs"]
        expected = {"looped_bfs": [rank, rank + R], "zbv": _v(rank, R), "dualpipev": _v(rank, R),
                    "blocks": [2 * rank, 2 * rank + 1],
                    "blocks-reversed": [2 * (R - 1 - rank), 2 * (R - 1 - rank) + 1], "torch_zbv": _v(rank, R),
                    "torch_dualpipev": _v(rank, R)}
        for name in ("looped_bfs", "zbv", "dualpipev", "blocks", "blocks-reversed", *csvs):
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == expected.get(name, [rank, rank + R]), (name, r)
            assert r["losses_equal"] and r["weights_equal"], (name, r)
            assert r["updates"] == [2, 2] and r["leftovers"] == 0, (name, r)
        for name in ("zbv", "dualpipev", "blocks", "blocks-reversed"):
            assert got[name]["evaluate_equal"], (name, got[name])
        assert got["dualpipev"]["resumed_equal"], got["dualpipev"]
        for name in ("zbv", "blocks"):  # an input stage 0 refuses stops every rank, then runs on
            r = got[name]
            assert r["reject"].startswith("PipelineInputError") and "stage 0" in r["reject"], r
            assert r["unchanged"] and r["then_equal"], r
        for name in ("zbv-varlen-tied", "dualpipev-varlen-tied"):
            r = got[name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == _v(rank, R) and r["ties"] == 1, (name, r)
            assert r["losses_equal"] and r["weights_equal"], (name, r)


def test_v_placement_with_data_parallel_replicas() -> None:
    """2 ranks x 2 replicas (world 4): zbv and dualpipev equal one local replica fed the
    2x batch (close: the all-reduce sums in another order)."""
    results = spawn(4, [("v_data_parallel", dict(R=2, dp=2))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name, r in res["v_data_parallel"].items():
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == _v(rank % 2, 2) and r["replica"] == rank // 2, (name, r)
            assert r["max_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (name, r)
