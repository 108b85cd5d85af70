"""bench/optim.py: every side computes what it claims, the byte counts, and a CPU smoke run.

GPU numbers come from .ci/gpu; these tests guard the script on CPU: the correctness check
before timing (and that it excludes a peer that computes something else), the engine timed
through ``opt.step()`` over a flattened bucket, the careful in-place composition, the CSVs
in their schemas and the plot.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from bench_support import load_bench

from engine.optim.functional import prediction_coeff, sgd_update

bench = load_bench("optim")
CPU = torch.device("cpu")


@pytest.mark.slow
def test_optim_benchmark_quick_run_writes_csv_and_plot(tmp_path: Path, capsys) -> None:
    common = load_bench("common")
    harness = load_bench("harness")
    assert bench.main(["--device", "cpu", "--quick", "--dtypes", "fp32,bf16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    with (tmp_path / "optim.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows and list(rows[0]) == common.COLUMNS
    seen = {(r["kernel"], r["provider"], r["dtype"]) for r in rows}
    for dtype in ("fp32", "bf16"):
        assert ("copy", "torch", dtype) in seen
        for kernel in bench.KERNELS:
            # the state_dtype="param" cases run for bf16 weights only
            assert ((kernel, "engine", dtype) in seen) == bench.runs_for(kernel, bench.DTYPES[dtype])
        assert ("sgd", "torch_foreach", dtype) in seen
        assert ("adamw", "torch_fused", dtype) in seen
    assert all(float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    assert (tmp_path / "optim.png").stat().st_size > 1000
    # every speed ratio comes from the paired harness, in its schema, against every peer that
    # passed its check, with both sides' bytes per parameter
    ratios = harness.read_ratio_csv(tmp_path / "optim_ratios.csv")
    got = {(r.case.split()[0], r.peer, r.case.split()[1]) for r in ratios}
    expected = {
        (k, peer, d)
        for d in ("fp32", "bf16")
        for k, peers in (("sgd", ("torch_fused", "torch_foreach")),
                         ("sgd_sc_pred", ("torch_composition",)),
                         ("adam", ("torch_fused", "torch_foreach")),
                         ("adamw", ("torch_fused", "torch_foreach")),
                         ("adamw_sc_pred", ("torch_fused_adamw+pred",)))
        for peer in peers
    } | {(k + "_bf16st", peer, "bf16") for k in ("sgd", "adam", "adamw")
         for peer in ("torch_fused", "torch_foreach")}
    excluded = {(k, p, d) for k, p, d in expected if f"EXCLUDED {k} {d} {p}:" in out}
    # torch 2.12/2.13's CPU fused SGD skips the vectorised part of bf16 updates (#191763)
    assert excluded <= {("sgd", "torch_fused", "bf16"), ("sgd_bf16st", "torch_fused", "bf16")}, excluded
    assert got == expected - excluded
    assert "cupy_elementwise: CuPy runs on CUDA only" in out
    for r in ratios:
        assert r.candidate == "engine" and r.rounds == 3 and r.ci_low <= r.median_ratio <= r.ci_high
        assert r.extra["candidate_bytes_per_param"] > 0 and r.extra["peer_bytes_per_param"] > 0
        assert "check: engine same math" in r.note
    assert "bytes/param" in out and "byte ratio" in out


def test_traffic_model_counts_each_stream_once() -> None:
    n = 1000
    assert bench.traffic_bytes("copy", n, 4, 4) == 8 * n
    assert bench.traffic_bytes("sgd", n, 2, 4) == n * (3 * 2 + 2 * 4)
    assert bench.traffic_bytes("sgd_sc_pred", n, 2, 4) == n * (4 * 2 + 2 * 4)
    assert bench.traffic_bytes("adam", n, 4, 4) == n * (3 * 4 + 4 * 4)
    assert bench.traffic_bytes("adamw", n, 4, 4) == n * (3 * 4 + 4 * 4)
    assert bench.traffic_bytes("adamw_sc_pred", n, 4, 4) == n * (4 * 4 + 4 * 4)
    assert bench.traffic_bytes("adam_bf16st", n, 2, 2) == n * (3 * 2 + 4 * 2)  # 14 B/param
    with pytest.raises(ValueError, match="unknown kernel"):
        bench.traffic_bytes("lamb", n, 4, 4)


def _sides(kernel: str, dtype: torch.dtype = torch.float32, numel: int = 1000):
    return bench.build_all(kernel, CPU, dtype, numel, bench.TIMED, 1e-2, log=lambda _m: None)


def test_bytes_per_param_of_every_side() -> None:
    """The traffic model printed beside every ratio (fp32 and bf16 weights)."""
    want = {
        ("sgd", torch.float32): {"engine": 20, "torch_fused": 20, "torch_foreach": 32},
        ("sgd_sc_pred", torch.float32): {"torch_composition": 48},
        ("sgd_sc_pred", torch.bfloat16): {"engine": 16, "torch_composition": 44},
        ("adam", torch.float32): {"engine": 28, "torch_fused": 28, "torch_foreach": 72},
        ("adamw", torch.float32): {"engine": 28, "torch_fused": 28, "torch_foreach": 80},
        ("adamw", torch.bfloat16): {"engine": 22, "torch_fused": 14, "torch_foreach": 40},
        # state_dtype="param": torch fused's bytes (issue 22)
        ("sgd_bf16st", torch.bfloat16): {"engine": 10, "torch_fused": 10},
        ("adam_bf16st", torch.bfloat16): {"engine": 14, "torch_fused": 14},
        ("adamw_bf16st", torch.bfloat16): {"engine": 14, "torch_fused": 14},
        ("adamw_sc_pred", torch.float32): {"torch_fused_adamw+pred": 48},
    }
    for (kernel, dtype), sides in want.items():
        built = _sides(kernel, dtype)
        for name, nbytes in sides.items():
            assert built[name].bytes_per_param == nbytes, (kernel, dtype, name)
    # the engine's count follows its state: 24 = the minimum for SGD+SC+pred in fp32, and
    # Adam+SC+pred's 32 plus whatever state it keeps beyond the two moments
    sgd = _sides("sgd_sc_pred")["engine"]
    assert sgd.bytes_per_param == 24 and "w_hat w (4)" in sgd.how
    adam = _sides("adamw_sc_pred")["engine"]
    assert adam.bytes_per_param in (32, 36)
    assert (adam.bytes_per_param == 36) == ("last_update" in adam.how)


def test_counted_traffic_is_the_model_for_every_torch_side() -> None:
    """count_traffic (aten operators' tensors read and written, one step) agrees with the
    hand-written model of every torch formulation; the engine on CPU runs its reference path,
    which moves more than its fused kernel would, and is reported as counted."""
    numel = 8 * 512  # whole 256-byte slots: no arena padding in the engine's count
    for kernel in bench.KERNELS:
        for dtype in (torch.float32, torch.bfloat16):
            for name, side in _sides(kernel, dtype, numel).items():
                model = side.bytes_per_param
                side.count_bytes(numel)
                if name == "engine" and "fused CPU loop" in side.how:
                    # SGD with SC/prediction in fp32 runs engine._C's one-pass loop, which
                    # count_traffic cannot see into: the model's bytes stay, said so
                    assert kernel.startswith("sgd") and dtype == torch.float32, (kernel, dtype)
                    assert side.bytes_source == "model" and side.bytes_per_param == model
                    continue
                assert side.bytes_source == "counted"
                if name == "engine":
                    assert side.bytes_per_param >= model and "reference path" in side.how
                else:
                    assert side.bytes_per_param == pytest.approx(model, abs=0.05), (kernel, dtype, name)
    nbytes, ops = bench.count_traffic(lambda: torch.zeros(100).add_(1.0))
    assert (nbytes, ops) == (100 * 4 + 2 * 100 * 4, 2)  # zero_ writes; add_ reads and writes
    t = torch.ones(10)
    assert bench.count_traffic(lambda: t.view(2, 5).detach())[0] == 0  # views move nothing


def test_engine_side_steps_a_flattened_bucket_through_opt_step() -> None:
    side = _sides("sgd_sc_pred")["engine"]
    opt = side.step.__self__  # the bound opt.step a user calls
    assert type(opt).__module__.startswith("engine.optim")
    params = opt.param_groups[0]["params"]
    assert len(params) == bench.TENSORS
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == 1  # one arena buffer
    assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 1


def test_composition_peer_computes_what_the_fused_kernel_computes() -> None:
    """The plain-torch peer must produce the same weights, momentum and prediction, or the
    speed ratio compares different work."""
    torch.manual_seed(0)
    w = torch.randn(1000)
    g = torch.randn(1000) * 1e-2
    side = bench.composition_provider("sgd_sc_pred", w, g, bench.TIMED)  # steps once
    w_ref, v_ref, pred_ref = w.clone(), torch.zeros(1000), torch.empty(1000)
    coeff = prediction_coeff("linear", bench.LR, bench.MOMENTUM, bench.DELAY)
    for k in range(3):
        if k:
            side.step()
        sgd_update(
            w_ref, g, v_ref, lr=bench.LR, momentum=bench.MOMENTUM, dampening=0.0, weight_decay=0.0,
            nesterov=False, maximize=False, init_momentum=k == 0, sc_delay=bench.DELAY,
            predicted=pred_ref, predict_coeff=coeff,
        )
    torch.testing.assert_close(side.weights(), w_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(side.step.momentum, v_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(side.predicted(), pred_ref, rtol=1e-6, atol=1e-7)


def test_composition_peer_allocates_nothing_per_step() -> None:
    """In place: no tensor is created by a steady-state step (the old peer copied the whole
    gradient and made a temporary for the prediction every step)."""
    for dtype in (torch.float32, torch.bfloat16):
        side = bench.composition_provider("sgd_sc_pred", torch.randn(4096).to(dtype),
                                          torch.randn(4096).to(dtype), bench.TIMED)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            side.step()
        allocs = [e for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage > 0]
        assert not allocs, (dtype, [(e.name, e.cpu_memory_usage) for e in allocs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_side_passes_the_check_before_timing(dtype: torch.dtype) -> None:
    for kernel in bench.KERNELS:
        passed, failed = bench.check_kernel(kernel, CPU, dtype, log=lambda _m: None)
        assert "engine" in passed
        # only torch's own CPU fused SGD on bf16 may fail (pytorch/pytorch#191763)
        sgd_bf16 = bench.base_kernel(kernel) == "sgd" and dtype == torch.bfloat16
        assert set(failed) <= ({"torch_fused"} if sgd_bf16 else set())
    passed, _ = bench.check_kernel("adamw_sc_pred", CPU, dtype, log=lambda _m: None)
    assert passed["torch_fused_adamw+pred"].startswith("no SC")  # different math, said so


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_excludes_a_peer_that_skips_a_term(monkeypatch, dtype: torch.dtype) -> None:
    """A composition without the prediction's c*v term, and one without spike compensation,
    are caught in both dtypes; the engine failing would raise instead."""
    real = bench.builders

    def broken(which: str):
        def build(kernel, w, g, h):
            side = bench.composition_provider(kernel, w, g, h)
            pred, v = side.step.predicted, side.step.momentum
            if which == "no-pred":
                inner = side.step

                def step() -> None:
                    inner()
                    pred.add_(v.to(pred.dtype), alpha=bench.CHECKED.lr * bench.CHECKED.horizon)

                side.step = step
            else:
                side.applies_sc = False  # claims SC but the reference then has none
            return side

        return build

    for which in ("no-pred", "no-sc"):
        def patched(kernel, device, dt, which=which):
            found, skipped = real(kernel, device, dt)
            found["broken"] = broken(which)
            return found, skipped

        monkeypatch.setattr(bench, "builders", patched)
        passed, failed = bench.check_kernel("sgd_sc_pred", CPU, dtype, log=lambda _m: None)
        assert "broken" in failed and "broken" not in passed, which
        assert "does not compute what it claims" in failed["broken"]


def test_cuda_request_without_a_gpu_says_so(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    assert bench.main(["--out", "/nonexistent/never-written"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
