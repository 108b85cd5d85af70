"""The optimizer benchmark's harness runs end to end on CPU (interpreted kernels, tiny buffer).

GPU numbers come from .ci/gpu; this test only guards the script itself: every provider runs,
the CSV has the shared schema and the plot is written.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from bench_support import load_bench


@pytest.mark.slow
def test_optim_benchmark_smoke_writes_csv_and_plot(tmp_path: Path) -> None:
    bench = load_bench("optim")
    common = load_bench("common")
    assert bench.main(["--device", "cpu", "--smoke", "--dtypes", "fp32,bf16", "--out", str(tmp_path)]) == 0
    with (tmp_path / "optim.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows and list(rows[0]) == common.COLUMNS
    seen = {(r["kernel"], r["provider"], r["dtype"]) for r in rows}
    for dtype in ("fp32", "bf16"):
        assert ("copy", "torch", dtype) in seen
        assert ("sgd", "engine", dtype) in seen
        assert ("sgd", "torch_foreach", dtype) in seen
        assert ("sgd_sc_pred", "engine", dtype) in seen
        assert ("sgd_sc_pred", "torch_composition", dtype) in seen
        assert ("adam", "engine", dtype) in seen
    assert all(float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    assert (tmp_path / "optim.png").stat().st_size > 1000
    # every speed ratio comes from the paired harness, in its schema
    harness = load_bench("harness")
    ratios = harness.read_ratio_csv(tmp_path / "optim_ratios.csv")
    expected = {(k, "engine", peer, d) for d in ("fp32", "bf16")
                for k, peer in (("sgd", "torch_foreach"), ("sgd_sc_pred", "torch_composition"),
                                ("adam", "torch_foreach"))}
    assert {(r.case.split()[0], r.candidate, r.peer, r.case.split()[1]) for r in ratios} == expected
    assert all(r.rounds == 3 and r.ci_low <= r.median_ratio <= r.ci_high for r in ratios)


def test_traffic_model_counts_each_stream_once() -> None:
    bench = load_bench("optim")
    n = 1000
    assert bench.traffic_bytes("copy", n, 4, 4) == 8 * n
    assert bench.traffic_bytes("sgd", n, 2, 4) == n * (3 * 2 + 2 * 4)
    assert bench.traffic_bytes("sgd_sc_pred", n, 2, 4) == n * (4 * 2 + 2 * 4)
    assert bench.traffic_bytes("adam", n, 4, 4) == n * (3 * 4 + 4 * 4)
    with pytest.raises(ValueError, match="unknown kernel"):
        bench.traffic_bytes("lamb", n, 4, 4)


def test_composition_peer_computes_what_the_fused_kernel_computes() -> None:
    """The plain-torch peer must produce the same weights, momentum and prediction, or the
    speed ratio compares different work."""
    import torch

    from engine.optim.functional import prediction_coeff, sgd_update

    bench = load_bench("optim")
    torch.manual_seed(0)
    w = torch.randn(1000)
    g = torch.randn(1000) * 1e-2
    w_ref, v_ref, pred_ref = w.clone(), torch.zeros(1000), torch.empty(1000)
    run = bench._composition_provider(w, g)
    for _ in range(3):
        run()
        sgd_update(
            w_ref, g, v_ref, lr=bench.LR, momentum=bench.MOMENTUM, dampening=0.0, weight_decay=0.0,
            nesterov=False, maximize=False, init_momentum=False, sc_delay=bench.DELAY,
            predicted=pred_ref,
            predict_coeff=prediction_coeff("linear", bench.LR, bench.MOMENTUM, bench.DELAY),
        )
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(run.momentum, v_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(run.predicted, pred_ref, rtol=1e-6, atol=1e-7)
