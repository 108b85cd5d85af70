"""bench/schedule_memory.py: a quick run writes one ratio row per family with each rank's
measured and predicted saved-activation bytes; the prediction is exact on this model, V-Min
holds less than V-Half, V-Half less than 1F1B; the counting hooks see every saved tensor
released once the step is done, and count a tensor saved twice once."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from bench_support import load_bench

bench = load_bench("schedule_memory")
pytestmark = pytest.mark.slow  # real pipelines and timed rounds: ~10 s on a loaded CPU


def test_quick_run_writes_measured_and_predicted_peaks(tmp_path) -> None:  # noqa: ANN001
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "schedule_memory.csv", newline="") as f:
        rows = {r["candidate"]: r for r in csv.DictReader(f)}
    assert list(rows) == [f"engine {n}" for n in bench.FAMILIES]
    peak = {}
    for name in bench.FAMILIES:
        extra = json.loads(rows[f"engine {name}"]["extra"])
        assert extra["measured_peak_bytes"] == extra["predicted_peak_bytes"], name
        assert extra["prediction_within_5pct"] and len(extra["measured_peak_bytes"]) == 4
        peak[name] = max(extra["measured_peak_bytes"])
        assert float(rows[f"engine {name}"]["median_ratio"]) > 0
    assert peak["vmin"] < peak["vhalf"] < peak["1f1b"] == peak["zbv"]
    # p = 4: the paper's (p+4)//3 = 2 and (p+2)//2 = 3 of 1F1B's 4
    assert json.loads(rows["engine vmin"]["extra"])["peak_ratio_to_1f1b"] == 0.5
    assert json.loads(rows["engine vhalf"]["extra"])["peak_ratio_to_1f1b"] == 0.75


def test_meter_counts_each_saved_tensor_once_until_it_is_dropped() -> None:
    meter = bench.SavedBytes()
    lin = bench.Metered(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()))
    lin.meter = meter
    x = torch.randn(3, 4, requires_grad=True)
    out = lin(x)
    # Linear saves its input (x), Tanh its output: two 3x4 float32 tensors, weights excluded
    assert meter.now == meter.peak == 2 * 3 * 4 * 4
    out.sum().backward()
    del out
    assert meter.now == 0 and meter.peak == 96
