"""Analysis: measured delays, versions, activation peaks and bubbles equal ALGORITHMS.md's formulas."""

from __future__ import annotations

import pytest

from engine.schedule import Costs, analyze, generate

GRID = [(S, M, T) for S in (1, 2, 3, 4, 8) for M in sorted({1, S, 2 * S + 1}) for T in (1, 3)]


def _expected_delay(name: str, order: str | None, S: int, s: int, n: int, M: int) -> int:
    """Closed-form delay of micro-batch n at stage s (k = 1 for async, M for sync/2bw)."""
    if name in ("naive", "gpipe", "1f1b"):
        return 0
    if name == "2bw":
        return 0 if n < M else 1
    if name == "pb" and order == "dataflow":
        return min(n, 2 * (S - 1 - s))
    return min(n, S - 1 - s)  # pipedream, pb in 1f1b order


CASES = [
    (name, order)
    for name, orders in [
        ("naive", [None]),
        ("gpipe", [None]),
        ("1f1b", [None]),
        ("pipedream", [None]),
        ("2bw", [None]),
        ("pb", ["dataflow", "1f1b"]),
    ]
    for order in orders
]


PARAMS = [(n, o, S, M, T) for n, o in CASES for S, M, T in GRID if not (n == "2bw" and M < S)]


@pytest.mark.parametrize("name, order, S, M, T", PARAMS)
def test_delays_match_formulas(name: str, order: str | None, S: int, M: int, T: int) -> None:
    rep = analyze(generate(name, stages=S, chunks=M, steps=T, order=order))
    N = M * T
    for s in range(S):
        per_mb = [r.delay for r in rep.records[s]]
        assert per_mb == [_expected_delay(name, order, S, s, n, M) for n in range(N)]
        assert rep.delays[s] == max(per_mb)
    if N >= 2 * S:  # steady state reached: the table of ALGORITHMS.md
        table = {
            "naive": [0] * S,
            "gpipe": [0] * S,
            "1f1b": [0] * S,
            "pipedream": [S - 1 - s for s in range(S)],
            "2bw": [1 if T > 1 else 0] * S,
            "pb": [2 * (S - 1 - s) if order == "dataflow" else S - 1 - s for s in range(S)],
        }[name]
        assert list(rep.delays) == table


@pytest.mark.parametrize("name, order, S, M, T", PARAMS)
def test_versions_and_activation_peaks(
    name: str, order: str | None, S: int, M: int, T: int
) -> None:
    rep = analyze(generate(name, stages=S, chunks=M, steps=T, order=order))
    N = M * T
    for s in range(S):
        peak = {
            "naive": 1,
            "gpipe": M,
            "1f1b": min(S - s, M),
            "pipedream": min(S - s, N),
            "2bw": min(S - s, N),
            "pb": min(2 * (S - 1 - s) + 1, N) if order == "dataflow" else min(S - s, N),
        }[name]
        assert rep.activation_peak[s] == peak
        if name == "pipedream" and N >= 2 * S:  # steady state reached
            assert rep.versions[s] == S - s
        elif name == "2bw":
            assert rep.versions[s] == (2 if T > 1 else 1)
        elif name != "pipedream":
            assert rep.versions[s] == 1


def test_weight_versions_per_policy() -> None:
    S, M, T = 3, 3, 3
    rep = analyze(generate("2bw", stages=S, chunks=M, steps=T))
    for s in range(S):
        for r in rep.records[s]:
            assert r.version_F == r.version_B == max(r.mb // M - 1, 0)
            assert r.update == r.mb // M + 1
    rep = analyze(generate("pipedream", stages=S, chunks=M, steps=T))
    for s in range(S):
        for r in rep.records[s]:
            assert r.version_B == r.version_F == r.t_F == max(0, r.mb - (S - 1 - s))
            assert r.t_B == r.mb  # k = 1: B(n) runs after n earlier updates
    rep = analyze(generate("pb", stages=S, chunks=M, steps=T))
    for s in range(S):
        for r in rep.records[s]:
            assert r.version_F == r.t_F == max(0, r.mb - 2 * (S - 1 - s))
            assert r.version_B == r.t_B == r.mb  # live weights in backward
            assert r.update == r.mb + 1


@pytest.mark.parametrize("S, M", [(1, 1), (2, 1), (2, 4), (3, 3), (4, 8), (8, 17)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("T", [1, 2])
def test_bubble_fraction_sync(name: str, S: int, M: int, T: int) -> None:
    rep = analyze(generate(name, stages=S, chunks=M, steps=T))
    assert rep.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    rep = analyze(generate(name, stages=S, chunks=M, steps=T), costs={"F": 2, "B": 3})
    assert rep.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))


@pytest.mark.parametrize("S, M, T", [(2, 2, 3), (4, 4, 3), (4, 9, 2)])
@pytest.mark.parametrize(
    "name, order", [("pipedream", None), ("2bw", None), ("pb", "1f1b"), ("pb", "dataflow")]
)
def test_bubble_fraction_async_fills_and_drains_once(
    name: str, order: str | None, S: int, M: int, T: int
) -> None:
    rep = analyze(generate(name, stages=S, chunks=M, steps=T, order=order))
    N = M * T
    assert rep.bubble_fraction == pytest.approx((S - 1) / (N + S - 1))


def test_naive_bubble() -> None:
    rep = analyze(generate("naive", stages=4, chunks=3))
    assert rep.bubble_fraction == pytest.approx(3 / 4)
    assert rep.makespan == 3 * 4 * 3


def test_per_stage_costs() -> None:
    sched = generate("gpipe", stages=3, chunks=4)
    slow_middle = analyze(sched, Costs(forward=[1, 2, 1], backward=[2, 4, 2]))
    assert slow_middle.makespan > analyze(sched).makespan
    assert slow_middle.idle_fraction[1] < slow_middle.idle_fraction[0]
    assert slow_middle.bubble_fraction > analyze(sched).bubble_fraction
    with pytest.raises(ValueError, match="2 per-stage costs for 3 stages"):
        analyze(sched, Costs(forward=[1, 2]))
    with pytest.raises(ValueError, match="unknown cost keys"):
        analyze(sched, {"X": 1})


def test_records_times_and_summary() -> None:
    rep = analyze(generate("1f1b", stages=2, chunks=2))
    r = rep.record(0, 0)
    assert (r.f_start, r.f_end) == (0.0, 1.0)
    assert r.b_start == 1 + 1 + 2  # F0 on stage 1, then B0 on stage 1, then B0 here
    assert rep.record(1, 0).b_end == r.b_start
    text = rep.summary()
    assert "stage 1: delay 0" in text and "bubble 0.333" in text


def test_doc_example() -> None:
    assert analyze(generate("pb", stages=3, chunks=3)).delays == (2, 2, 0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("S", [2, 3, 4, 5])
@pytest.mark.parametrize("name, order", [("pb", "dataflow"), ("pb", "1f1b"), ("pipedream", None)])
def test_mean_delay_with_update_size_k(name: str, order: str | None, S: int, k: int) -> None:
    """With k > 1 the delay varies inside an update group; its steady mean is D_s(k=1) / k."""
    rep = analyze(generate(name, stages=S, chunks=k, steps=48, update_size=k, order=order))
    for s in range(S):
        d1 = 2 * (S - 1 - s) if order == "dataflow" else S - 1 - s
        assert rep.mean_delays[s] == pytest.approx(d1 / k)
        if k == 1:
            assert rep.delays[s] == d1
