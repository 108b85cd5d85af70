"""bench/recompute.py: a quick run writes both ratio rows per case, with the measured
activation bytes, and recomputation holds fewer of them; the two pipelines it times do the
same math (recomputation changes memory and time, not the weights)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from bench_support import load_bench

bench = load_bench("recompute")
pytestmark = pytest.mark.slow  # real pipelines, timed rounds: tens of seconds on a loaded CPU


def test_quick_run_writes_rows_with_memory(tmp_path) -> None:
    assert bench.main(["--quick", "--cases", "cnn", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "recompute.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["candidate"], r["peer"]) for r in rows] == [
        ("checkpoint=except_last", "checkpoint=never"),
        ("checkpoint=never", "torch, unsplit, same micro-batches"),
    ]
    extra = json.loads(rows[0]["extra"])
    assert 0 < extra["act_recompute_kib"] < extra["act_never_kib"]
    assert float(rows[0]["median_ratio"]) > 0


def test_both_modes_train_the_same_weights() -> None:
    make, x, y, loss_fn = bench.gpt_case()
    pipes = [bench.pipeline(make(), mode, loss_fn) for mode in ("except_last", "never")]
    for _ in range(2):
        for p in pipes:
            p.step(x, y)
    a, b = ([t for st in p.stages for t in st.module.state_dict().values()] for p in pipes)
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
