"""Rank programs under gloo (2 and 4 processes): looped BFS and the schedules torch 2.13's
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and ScheduleLoopedBFS dump as CSV train
bit for bit like the local run (which equals the unpipelined model, test_schedule_vshape_runtime);
the V placement (zbv, dualpipev) is refused across processes, naming the placement."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_support import spawn
from test_schedule_tdp_csv import torch_schedule

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("R", [2, 4])
def test_rank_programs_under_gloo(R: int, tmp_path: Path) -> None:
    csvs = {}
    for kind in ("interleaved", "interleaved_zb", "looped_bfs"):
        path = tmp_path / f"{kind}.csv"
        torch_schedule(kind, R, 4)._dump_csv(str(path), format="compute_comms")
        csvs[f"torch_{kind}"] = path.read_text()
    results = spawn(R, [("rank_programs", dict(R=R, csvs=csvs))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        got = res["rank_programs"]
        for name in ("looped_bfs", *csvs):
            assert got[name]["stages"] == [rank, rank + R], name
            assert got[name]["losses_equal"] and got[name]["weights_equal"], (name, got[name])
        assert "only round-robin placement runs" in got["zbv_refused"], got["zbv_refused"]
