"""Step features across processes (gloo): clipping's global norm spans every rank's stages
(bit for bit the local run with one replica; with data-parallel replicas equal to one replica
with the larger batch up to the rounding of the replica mean); float16 loss scaling's one
found_inf per step spans the ranks (the same steps skipped, the same weights as the local run);
asynchronous float16's per-stage scales travel with the gradients between ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from features_dist_support import spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]


def _ok(results: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    out = []
    for res in results:
        assert "fatal" not in res, res.get("fatal")
        assert phase in res, res
        for name, r in res[phase].items():
            assert "error" not in r, f"{name}: {r['error']}"
        out.append(res[phase])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_clip_under_gloo_equals_the_local_run(world: int) -> None:
    for rank_res in _ok(spawn(world, [("clip", dict(S=world))]), "clip"):
        assert len(rank_res) == 7
        for name, r in rank_res.items():
            assert r["weights_equal"] and r["losses_equal"], (name, r)
            assert r["norm"] == r["ref_norm"], (name, r)


def test_clip_with_data_parallel_replicas() -> None:
    for rank_res in _ok(spawn(4, [("clip", dict(S=2, R=2))]), "clip"):
        assert set(rank_res) == {"gpipe", "pipedream"}
        for name, r in rank_res.items():
            assert r["max_diff"] < 1e-5, (name, r)
            assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], (name, r)
            assert r["ref_norm"] > 0.02  # the runs clip


def test_mixed_precision_under_gloo_equals_the_local_run() -> None:
    for rank_res in _ok(spawn(2, [("amp", dict(S=2))]), "amp"):
        assert len(rank_res) == 7
        for name, r in rank_res.items():
            assert r["weights_equal"] and r["losses_equal"], (name, r)
            # evaluate() under the pipeline's autocast: gloo == local == torch.autocast
            assert r["eval_equal"] and r["eval_dtype"] != "torch.float32", (name, r)
            assert r["moved"] or "overflow" in name, (name, r)
            assert r["skipped"] == r["ref_skipped"] and r["scale"] == r["ref_scale"], (name, r)
            assert r["group_skips"] == r["ref_group_skips"], (name, r)
            if "fp16" in name and name.startswith(("gpipe", "1f1b", "naive")):
                assert r["skipped"] > 0, (name, r)  # the synchronous float16 runs skip steps
            if "overflow" in name:  # 2^40 overflows: groups skipped, backing off, until it fits
                assert r["group_skips"] > 0 and r["scale"] < 2.0**40, (name, r)
            if name == "pb-fp16-clip":  # the scale grew, overflowed and backed off
                assert r["group_skips"] > 0 and r["scale"] > 2.0**6, (name, r)


def test_trace_under_gloo_merges_every_rank(tmp_path: Any) -> None:
    import json

    from engine.trace_events import validate as validate_trace_events

    path = str(tmp_path / "trace.json")
    res = spawn(2, [("trace", dict(S=2, path=path))])
    for r in res:
        assert "fatal" not in r, r.get("fatal")
        assert r["trace"]["weights_equal"]
        tp = r["trace"]["throughput"]  # a rank's measured bubble: its time outside its stage
        assert tp["steps"] == 3 and tp["samples_per_s"] > 0
        assert 0.0 < tp["bubble_measured"] < 1.0
    doc = json.loads(open(path).read())
    assert validate_trace_events(doc) == []
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    cats = {(e["pid"], e["cat"]) for e in events}
    assert {(0, "forward"), (0, "backward"), (0, "update"), (1, "forward"), (1, "update")} <= cats
    sends = [e for e in events if e["name"] == "send"]
    recvs = [e for e in events if e["name"] == "recv"]
    assert {e["args"]["channel"] for e in sends} == {"act", "grad"}
    assert len(sends) == len(recvs) == 2 * 3 * 4  # 3 steps x 4 micro-batches, both ways
    # one clock: the last stage's first forward starts after stage 0's first forward began
    first = {pid: min(e["ts"] for e in events if e["pid"] == pid and e["cat"] == "forward")
             for pid in (0, 1)}
    assert first[1] > first[0]
