"""Checkpoints that move between layouts under gloo (tests/relayout_support.py says what each
rank runs).

* Saved by a gloo pipeline of S = ranks stages (4 by default; ENGINE_TEST_RANKS=2 for the
  quick run), loaded into one-process pipelines of S/2 and 1 stages: the continuation equals
  the S-stage one bit for bit (gpipe, 1f1b; SGD with momentum, AdamW); loaded into a gloo
  pipeline of S/2 stages x 2 data-parallel replicas: within 1e-6, each rank reading only the
  files of the stages it now holds. Rank 0's ``engine.export`` of the gloo run is the whole
  model; the other ranks get ``{}``. An unflushed asynchronous checkpoint is refused on
  every rank, naming both layouts and the fix, nothing changed.
* (slow, 8 processes) TP=2 x PP=2 x DP=2 saved, loaded at TP=1 x PP=2 and TP=2 x PP=1:
  within 1e-6, each rank reading only its own stage's or shard's files; a TP pipeline
  started from the exported model file holds it exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from distributed_support import RANKS, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

PHASE = "relayout_support.phase_relayout"
CASES = ("sgd-gpipe", "sgd-1f1b", "adamw-gpipe", "adamw-1f1b")


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("relayout"))
    res = spawn(RANKS, [(PHASE, dict(root=root))], timeout=500)
    for r, got in enumerate(res):
        assert got and "fatal" not in got, f"rank {r}: {got.get('fatal')}"
    return [got[PHASE] for got in res]


@pytest.mark.parametrize("case", CASES)
def test_gloo_checkpoint_continues_bitwise_in_one_process_at_fewer_stages(
    moved: list[dict[str, Any]], case: str
) -> None:
    for rank, res in enumerate(moved):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        for S in {max(RANKS // 2, 1), 1}:
            assert got[f"local_S{S}"] is True, (rank, S)


@pytest.mark.parametrize("case", CASES)
def test_gloo_checkpoint_moves_to_fewer_stages_with_replicas(moved: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(moved):
        got = res[case]
        assert got["dp_diff"] <= 1e-6, (rank, got["dp_diff"])
        assert got["reads_own_files"] is True, rank
        assert got["index_sums"] is True, rank  # the manifest commits each file's header sum
        assert 0 < got["read_fraction"] < 1, (rank, got["read_fraction"])


def test_rank0_exports_the_whole_model(moved: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(moved):
        for case in CASES:
            assert res[case]["export_rank0_whole"] is True, (rank, case)


def test_unflushed_checkpoint_is_refused_on_every_rank(moved: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(moved):
        got = res["refusal"]
        assert "error" not in got, got.get("error")
        msg = got["message"]
        for needle in (f"{RANKS} stages of 'pipedream', {RANKS} processes",
                       f"data_parallel=2, {RANKS} processes", "saved unflushed",
                       "pipe.flush() before engine.save", "nothing was loaded"):
            assert needle in msg, (rank, needle, msg)
        assert got["unchanged"] is True, rank


@pytest.mark.slow  # 8 gloo processes (about a minute on 2 cores)
def test_tensor_parallel_checkpoint_moves_between_tp_and_pp_degrees(tmp_path: Any) -> None:
    phase = "relayout_support.phase_relayout_tp"
    res = spawn(8, [(phase, dict(root=str(tmp_path)))], timeout=590)
    from relayout_support import tp_layer

    keys = sorted(k for i in range(4) for k in (f"{i}.{n}" for n in tp_layer(i).state_dict()))
    for rank, got in enumerate(res):
        assert got and "fatal" not in got, f"rank {rank}: {got.get('fatal')}"
        out = got[phase]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["tp1_pp2"] <= 1e-6 and out["tp2_pp1"] <= 1e-6, (rank, out)
        assert out["tp1_pp2_reads_own_stage"] is True, rank
        assert out.get("tp2_pp1_reads_own_shards", True) is True, rank
        assert out["from_file"] is True, rank
    assert res[0][phase]["export_keys"] == keys
    assert any("tp2_pp1_reads_own_shards" in got[phase] for got in res)
