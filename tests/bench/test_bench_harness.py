"""The shared ratio harness (bench/harness.py) and the overhead benchmark built on it.

The statistics are tested on synthetic per-round timings (no clocks, so no flakes); the
timing loop with counting callables and a fake clock-free probe; the benchmark script with
a --quick subprocess run.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

harness = load_bench("harness")


def _synthetic(true_ratio: float, rounds: int, seed: int, noise: float = 0.08):
    """Per-round times of a peer (1 ms, drifting load) and a candidate true_ratio times slower,
    each with independent multiplicative noise."""
    rng = np.random.default_rng(seed)
    drift = 1 + 0.5 * np.sin(np.arange(rounds) / 3)  # load that both sides of a round share
    peer = 1e-3 * drift * rng.lognormal(0, noise, rounds)
    cand = true_ratio * 1e-3 * drift * rng.lognormal(0, noise, rounds)
    return cand.tolist(), peer.tolist()


def test_interval_covers_the_true_ratio_at_about_the_nominal_rate() -> None:
    hits = 0
    trials = 200
    for seed in range(trials):
        cand, peer = _synthetic(1.27, 31, seed)
        st = harness.ratio_stats(cand, peer, resamples=2000, seed=seed)
        assert st.low <= st.median <= st.high
        hits += st.low <= 1.27 <= st.high
    # the percentile bootstrap of a median is roughly nominal; far below means it is broken
    assert hits / trials >= 0.88, f"95% interval covered the true ratio in {hits}/{trials} trials"


def test_interval_excludes_a_wrong_ratio_and_narrows_with_rounds() -> None:
    cand, peer = _synthetic(1.5, 41, 0)
    st = harness.ratio_stats(cand, peer)
    assert abs(st.median - 1.5) < 0.05
    assert not st.low <= 1.0 <= st.high
    few = harness.ratio_stats(*_synthetic(1.5, 9, 1))
    many = harness.ratio_stats(*_synthetic(1.5, 81, 1))
    assert many.high - many.low < few.high - few.low


def test_pairing_cancels_drift_shared_by_a_round() -> None:
    """Drift of 3x across rounds, ratio exactly 2 in every round: the interval is a point."""
    peer = [1.0, 3.0, 2.0, 1.5, 2.5]
    st = harness.ratio_stats([2 * p for p in peer], peer)
    assert st.median == pytest.approx(2.0) and st.low == pytest.approx(2.0)
    assert st.high == pytest.approx(2.0)


def test_bootstrap_is_reproducible_with_its_fixed_seed() -> None:
    cand, peer = _synthetic(1.1, 15, 3)
    assert harness.ratio_stats(cand, peer) == harness.ratio_stats(cand, peer)
    assert harness.ratio_stats(cand, peer, seed=1) != harness.ratio_stats(cand, peer, seed=2)


def test_ratio_stats_rejects_bad_input_by_name() -> None:
    with pytest.raises(ValueError, match="one time per round"):
        harness.ratio_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no rounds"):
        harness.ratio_stats([], [])
    with pytest.raises(ValueError, match="peer > 0"):
        harness.ratio_stats([1.0], [0.0])


def test_round_order_alternates_so_neither_side_always_leads() -> None:
    order = harness.round_order(6)
    firsts = [o[0] for o in order]
    assert firsts.count("candidate") == 3 and firsts.count("peer") == 3
    assert all(sorted(o) == ["candidate", "peer"] for o in order)
    assert firsts[:2] == ["candidate", "peer"]


def test_paired_alternates_calls_and_applies_probes() -> None:
    calls: list[str] = []

    class Counter:
        """A probe counting the calls made inside each timed block."""

        name = "calls"

        def start(self) -> int:
            return len(calls)

        def stop(self, token: int) -> float:
            return float(len(calls) - token)

    res = harness.paired(lambda: calls.append("c"), lambda: calls.append("p"), rounds=4,
                         warmup=2, inner=3, probes=[Counter()], units_per_call=1)
    assert res.rounds == 4 and res.inner == 3
    assert [o[0] for o in res.order] == ["candidate", "peer", "candidate", "peer"]
    timed = calls[4:]  # after 2 warm-up calls of each side
    blocks = ["".join(timed[i : i + 3]) for i in range(0, len(timed), 3)]
    assert blocks == ["ccc", "ppp", "ppp", "ccc", "ccc", "ppp", "ppp", "ccc"]
    assert calls[:4] == ["c", "p", "p", "c"]  # warm-up alternates too
    assert res.extra == {"candidate_calls_per_call": 1.0, "peer_calls_per_call": 1.0}
    assert res.cpus == os.cpu_count() and res.load_before >= 0 and res.device.startswith("cpu")


def test_paired_calibrates_blocks_to_min_time() -> None:
    def work(n: int) -> int:
        return sum(range(n))

    res = harness.paired(lambda: work(4000), lambda: work(1000), rounds=3, warmup=1,
                         min_time=0.005)
    assert res.inner > 10  # calibrated on the faster side: a block of it lasts >= 5 ms
    assert 1.5 < res.stats.median < 8  # 4x the work; loose, this one does use the clock


def test_minor_faults_probe_sees_fresh_pages() -> None:
    probe = harness.MinorFaults()
    token = probe.start()
    buf = bytearray(64 << 20)  # fresh anonymous pages, touched by zero-fill
    assert probe.stop(token) > 100
    del buf


def test_ratio_csv_round_trips(tmp_path: Path) -> None:
    res = harness.paired(lambda: None, lambda: None, rounds=3, warmup=0, inner=2)
    row = res.row("overhead", "tiny S=8", "engine gpipe", "loop", label="CPU, 2 cores",
                  note="a, with comma", extra={"target": 1.25})
    path = tmp_path / "r.csv"
    harness.write_ratio_csv([row, row], path)
    with path.open() as fh:
        assert next(csv.reader(fh)) == harness.RATIO_COLUMNS
    back = harness.read_ratio_csv(path)
    assert back == [row, row]
    assert isinstance(back[0].rounds, int) and isinstance(back[0].median_ratio, float)
    line = harness.summary_line(row)
    assert line.startswith("tiny S=8 engine gpipe vs loop: ") and "(3 rounds, load " in line


def test_read_ratio_csv_names_a_foreign_schema(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("kernel,provider\nsgd,engine\n")
    with pytest.raises(ValueError, match="not the ratio schema"):
        harness.read_ratio_csv(path)


def test_pb_tick_loop_matches_the_engine_bitwise() -> None:
    """The pb peer's claim to do the engine's work, checked the way overhead.py checks it."""
    overhead = load_bench("overhead")
    assert overhead.tiny_case("pb").check() == "bitwise equal"


@pytest.mark.slow
def test_overhead_quick_run_writes_the_ratio_csv(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cases = "tiny-gpipe,tiny-pb,pb-batch1"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), "--quick", "--cases", cases,
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = harness.read_ratio_csv(tmp_path / "overhead.csv")
    assert [r.case for r in rows] == ["tiny S=8 M=8 gpipe", "tiny S=8 M=8 pb", "pb batch1 S=8 M=8"]
    for r in rows:
        assert r.rounds == 3 and r.median_ratio > 0 and r.ci_low <= r.median_ratio <= r.ci_high
        assert "candidate_minflt_per_call" in r.extra and r.extra["target"] > 1
    assert rows[0].note == "weights check: bitwise equal"
    assert (tmp_path / "overhead.md").read_text().count("\n") == 2 + len(rows)
    assert "x [" in proc.stdout
