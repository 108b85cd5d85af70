"""Instrumented runs: for every micro-batch at every stage, which weights its F and its B read
and which update consumed its gradient, against ALGORITHMS.md's tables; D_s against the
formulas. Probe values are compared with the recorded history of every stage's weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schedules import STASHED, SYNC, VARIANTS
from test_runtime_support import make_pipe, reads

import engine.optim as optim

SGD = torch.optim.SGD
GRID = [(S, M) for S in (1, 2, 3, 4, 8) for M in sorted({1, S, 2 * S + 1})]


def formula_delay(schedule: str, order: str | None, S: int, s: int) -> int:
    if schedule in SYNC:
        return 0
    if schedule == "2bw":
        return 1
    if schedule == "pb" and order != "1f1b":
        return 2 * (S - 1 - s)
    return S - 1 - s


def expected(
    schedule: str, order: str | None, S: int, M: int, k: int, s: int, n: int
) -> tuple[int, int, int]:
    """(t_F, version B reads, update consuming n) from ALGORITHMS.md (n counted from 0)."""
    w = S - 1 - s
    if schedule in SYNC:
        j = n // M
        return j, j, j
    if schedule == "2bw":
        v = max(n // M - 1, 0)
        return v, v, n // M
    if schedule == "pipedream":
        t = max(n - w, 0) // k
        return t, t, n // k
    lag = 2 * w if order != "1f1b" else w
    return max(n - lag, 0) // k, n // k, n // k


def run(S: int, M: int, schedule: str, opt, steps: int | None = None, **kw):
    pipe, probes, hist = make_pipe(S, schedule, M, opt, **kw)
    k = pipe.update_size
    steps = steps or max(3, math.ceil((2 * S + 2 * k + 1) / M))
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        pipe.step(torch.randn(M, 3, generator=g), torch.randn(M, 1, generator=g))
    pipe.flush()
    return pipe, reads(probes), hist, steps * M


def check_versions(pipe, got, hist, N, schedule, order=None, f_value=None, b_value=None) -> None:
    S, M, k = pipe.num_stages, pipe.chunks, pipe.update_size
    for s in range(S):
        for n in range(N):
            tF, tB, upd = expected(schedule, order, S, M, k, s, n)
            rec = pipe.stages[s].records[n]
            assert rec["t_F"] == tF, (s, n, rec)
            assert rec["update"] == upd, (s, n, rec)
            (wf,) = got[(s, n, "F")]
            # a split backward at stage 0 computes no input gradient: its one read is W's
            (wb,) = got.get((s, n, "B")) or got[(s, n, "W")]
            want_f = hist.w[s][tF] if f_value is None else f_value(s, tF)
            torch.testing.assert_close(
                wf, want_f, rtol=1e-6, atol=1e-7, msg=lambda m, s=s, n=n: f"F stage {s} mb {n}: {m}"
            )
            if b_value is None:
                want_b = hist.w[s][tB]
            else:
                want_b = b_value(s, tB, wf)
            torch.testing.assert_close(
                wb, want_b, rtol=1e-6, atol=1e-7, msg=lambda m, s=s, n=n: f"B stage {s} mb {n}: {m}"
            )
            for ww in got.get((s, n, "W"), []):  # W reads the weights B read
                torch.testing.assert_close(ww, want_b, rtol=1e-6, atol=1e-7)
            for wr in got.get((s, n, "R"), []):  # a recomputed forward reads what B reads
                torch.testing.assert_close(wr, want_b, rtol=1e-6, atol=1e-7)
            if schedule in ("naive", "gpipe", "1f1b", "pipedream", "2bw"):
                assert torch.equal(wf, wb)  # exact: the very same stored weights
    assert pipe.delays == [formula_delay(schedule, order, S, s) for s in range(S)]
    if k == 1:
        for s, counts in enumerate(pipe.stats()["measured_delays"]):
            assert max(counts) == pipe.delays[s]
            assert sum(counts.values()) == N


def check_step_prediction_or_t2(make, mitigation: str) -> None:
    """pb at S = M = 3 with an engine optimizer whose prediction extrapolates its last applied
    step (``state["last_update"]``: Adam, NAdam, Muon); ``make(params, **options)`` builds it.
    ``"prediction"``: every F reads w_t - D_s * last_update_t (LWP); ``"t2"``: every B reads
    PipeMare's w_t - D_s * delta_t, from the optimizer's own buffers."""
    record: list = []  # per stage: last_update of the probe weight after each update
    kw = {"prediction": "linear"} if mitigation == "prediction" else {"discrepancy_correction": True}

    def factory(params):
        opt = make(params, **kw)
        if mitigation == "prediction":
            p0, s = params[0], len(record)
            record.append([None])
            opt.register_step_post_hook(
                lambda o, *a: record[s].append(o.state[p0]["last_update"].clone()))
        return opt

    pipe, got, hist, N = run(3, 3, "pb", factory)
    D = pipe.delays

    def f_value(s, t):  # LWP from the applied step: w_t - D_s * (w_{t-1} - w_t)
        last = record[s][t]
        return hist.w[s][t] if last is None or D[s] == 0 else hist.w[s][t] - D[s] * last

    def b_value(s, t, wf):  # PipeMare T2: w_t - D_s * delta_t
        d = hist.delta[s][t]
        return hist.w[s][t] if d is None else hist.w[s][t] - D[s] * d

    if mitigation == "prediction":
        assert pipe.weight_prediction == "lwp"
        check_versions(pipe, got, hist, N, "pb", f_value=f_value)
    else:
        assert pipe.discrepancy_correction
        check_versions(pipe, got, hist, N, "pb", b_value=b_value)


@pytest.mark.parametrize("schedule", VARIANTS)
@pytest.mark.parametrize("S,M", GRID)
def test_versions_per_schedule(schedule: str, S: int, M: int) -> None:
    order = None
    if schedule == "pb-1f1b":
        schedule, order = "pb", "1f1b"
    if schedule == "2bw" and M < S:
        pytest.skip("2bw needs M >= S (tested as a config error)")
    if schedule == "zbh1" and S == 8:
        pytest.skip("zbh1 is 1f1b's version table; S <= 4 covers it at a third of the time")
    checkpoint = ["never", "always", "except_last"][(S * 7 + M) % 3]
    pipe, got, hist, N = run(
        S, M, schedule, lambda p: SGD(p, lr=0.05, momentum=0.9), checkpoint=checkpoint, order=order
    )
    check_versions(pipe, got, hist, N, schedule, order)
    st = pipe.stats()
    if schedule == "pipedream":
        assert st["weight_versions"] == [S - s for s in range(S)]
    if schedule == "2bw":
        assert max(st["weight_versions"]) <= 2
    if schedule in ("pb",) and order is None and checkpoint == "never":
        assert st["activation_peak"] == [min(2 * (S - 1 - s) + 1, N) for s in range(S)]
    if schedule in STASHED or order == "1f1b":
        assert all(a <= S - s for s, a in enumerate(st["activation_peak"]))
    if schedule in ("pb",) or schedule in STASHED:
        assert st["weight_versions"][-1] == 1 or schedule != "pb"


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("schedule,order", [("pb", None), ("pb", "1f1b"), ("pipedream", None)])
def test_update_size_k(schedule: str, order: str | None, k: int) -> None:
    S, M = 3, 3
    pipe, got, hist, N = run(
        S,
        M,
        schedule,
        lambda p: SGD(p, lr=0.05),
        update_size=k,
        order=order,
        steps=5,
        checkpoint="never",
    )
    # D_s for k > 1 is derived by simulation; the per-micro-batch facts must match the tables
    for s in range(S):
        for n in range(N):
            tF, tB, upd = expected(schedule, order, S, M, k, s, n)
            assert pipe.stages[s].records[n]["t_F"] == tF
            assert pipe.stages[s].records[n]["update"] == upd
    lag = [2 * (S - 1 - s) if (schedule == "pb" and order is None) else S - 1 - s for s in range(S)]
    # D_s with k-coalescing is the steady-state maximum: the stalest gradient of a group waits
    # ceil(lag / k) updates (docs/ALGORITHMS.md, "Choices made by this implementation")
    assert pipe.delays == [-(-L // k) for L in lag]
    steady = [max(counts) for counts in pipe.stats()["measured_delays"]]
    assert steady == pipe.delays  # the runtime measures the same maximum it was given
    assert pipe.stats()["updates"] == [math.ceil(N / k)] * S  # the flush applies the partial group


# ---------------------------------------------------------------------- mitigations

MIT_GRID = [(S, M) for S in (1, 2, 3, 4, 8) for M in sorted({1, S})]
LR = 0.05
MOM = 0.9


def _pred(hist, s: int, t: int, horizon: float, mode: str = "linear") -> torch.Tensor:
    v = hist.v[s][t]
    if v is None or horizon == 0:
        return hist.w[s][t]
    coeff = horizon if mode == "linear" else sum(MOM**j for j in range(1, int(horizon) + 1))
    return hist.w[s][t] - hist.lr[s][t] * coeff * v


@pytest.mark.parametrize("mode", ["linear", "momentum"])
@pytest.mark.parametrize("S,M", MIT_GRID)
def test_lwp(S: int, M: int, mode: str) -> None:
    ck = ["never", "always"][(S + M) % 2]
    pipe, got, hist, N = run(
        S, M, "pb", lambda p: optim.SGD(p, lr=LR, momentum=MOM, prediction=mode), checkpoint=ck
    )
    assert pipe.weight_prediction == "lwp"
    D = pipe.delays
    assert [st.optimizer.param_groups[0]["delay"] for st in pipe.stages] == D
    check_versions(pipe, got, hist, N, "pb", f_value=lambda s, t: _pred(hist, s, t, D[s], mode))


@pytest.mark.parametrize("variant", ["spectrain", "spectrain_reuse"])
@pytest.mark.parametrize("S,M", MIT_GRID)
def test_spectrain(S: int, M: int, variant: str) -> None:
    ck = ["never", "always"][(S + M) % 2]
    pipe, got, hist, N = run(
        S,
        M,
        "pb",
        lambda p: optim.SGD(p, lr=LR, momentum=MOM, prediction="linear"),
        weight_prediction=variant,
        checkpoint=ck,
    )

    def horizons(s: int) -> tuple[int, int]:
        if variant == "spectrain":
            return s // 2 + S - s - 1, s // 2
        return S - s - 1, 0

    def b_value(s: int, tB: int, wf: torch.Tensor) -> torch.Tensor:
        return wf if variant == "spectrain_reuse" else _pred(hist, s, tB, horizons(s)[1])

    check_versions(
        pipe,
        got,
        hist,
        N,
        "pb",
        f_value=lambda s, t: _pred(hist, s, t, horizons(s)[0]),
        b_value=b_value,
    )


@pytest.mark.parametrize("S,M", MIT_GRID)
def test_pipemare_t2(S: int, M: int) -> None:
    ck = ["never", "always"][(S + M) % 2]
    pipe, got, hist, N = run(
        S,
        M,
        "pb",
        lambda p: optim.SGD(p, lr=LR, momentum=MOM, discrepancy_correction=True),
        checkpoint=ck,
    )
    assert pipe.discrepancy_correction

    def b_value(s: int, tB: int, wf: torch.Tensor) -> torch.Tensor:
        d = hist.delta[s][tB]
        return hist.w[s][tB] if d is None else hist.w[s][tB] - pipe.delays[s] * d

    check_versions(pipe, got, hist, N, "pb", b_value=b_value)


def test_t2_runtime_fallback_equals_engine_optimizer() -> None:
    """discrepancy_correction=True with plain torch SGD: the runtime tracks delta itself."""
    a, *_ = run(
        3,
        3,
        "pb",
        lambda p: optim.SGD(p, lr=LR, momentum=MOM, discrepancy_correction=True),
        checkpoint="never",
    )
    b, *_ = run(
        3,
        3,
        "pb",
        lambda p: SGD(p, lr=LR, momentum=MOM),
        discrepancy_correction=True,
        checkpoint="never",
    )
    for sa, sb in zip(a.stages, b.stages, strict=False):
        for pa, pb_ in zip(sa.module.parameters(), sb.module.parameters(), strict=False):
            torch.testing.assert_close(pa, pb_, rtol=1e-5, atol=1e-6)


def test_lwp_runtime_fallback_equals_engine_optimizer() -> None:
    a, *_ = run(3, 3, "pb", lambda p: optim.SGD(p, lr=LR, momentum=MOM, prediction="linear"))
    b, *_ = run(3, 3, "pb", lambda p: SGD(p, lr=LR, momentum=MOM), weight_prediction="lwp")
    for sa, sb in zip(a.stages, b.stages, strict=False):
        for pa, pb_ in zip(sa.module.parameters(), sb.module.parameters(), strict=False):
            torch.testing.assert_close(pa, pb_, rtol=1e-5, atol=1e-6)


def test_spike_compensation_and_pipemare_lr_use_derived_delays() -> None:
    """SC and PipeMareLR read group["delay"], which the pipeline sets to the simulated D_s."""
    S, M = 4, 4
    seen: list[list[int]] = []

    def make(p):
        opt = optim.SGD(p, lr=LR, momentum=MOM, spike_compensation=True)
        opt.register_step_pre_hook(lambda o, *a: seen.append([g["delay"] for g in o.param_groups]))
        return opt

    pipe, got, hist, N = run(
        S, M, "pb", make, lr_scheduler=lambda o: optim.PipeMareLR(o, warmup_steps=4)
    )
    assert pipe.delays == [6, 4, 2, 0]
    assert {d for (d,) in seen} == {6, 4, 2, 0}
    # PipeMare T1 at step k: lr * tau ** -(1 - min(k/K, 1)), tau = max(D_s, 1)
    for s in range(S):
        tau = max(pipe.delays[s], 1)
        for t in range(1, 8):  # hist.lr[s][t]: the lr of the update that produced version t
            assert hist.lr[s][t] == pytest.approx(LR * tau ** -(1 - min((t - 1) / 4, 1.0)))
    # SC_D update: w' = w - lr * (m^D v + (1 - m^D)/(1 - m) g); check one update of stage 0 by
    # reconstructing g from the momentum: v_t = m v_{t-1} + g
    s, t, D = 0, 3, pipe.delays[0]
    v_prev, v_now = hist.v[s][t - 1], hist.v[s][t]
    g = v_now - MOM * v_prev
    a, b = MOM**D, (1 - MOM**D) / (1 - MOM)
    want = hist.w[s][t - 1] - hist.lr[s][t] * (a * v_now + b * g)
    torch.testing.assert_close(hist.w[s][t], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- flushes anywhere


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=st.sampled_from(["pipedream", "2bw", "pb", "pb-1f1b"]),
    S=st.integers(1, 4),
    M=st.integers(1, 4),
    k=st.integers(1, 3),
    plan=st.lists(st.booleans(), min_size=1, max_size=6),  # True: flush after this step
    checkpoint=st.sampled_from(["never", "except_last", "always"]),
)
def test_versions_with_flushes_anywhere(schedule, S, M, k, plan, checkpoint) -> None:
    """A flush ends a segment: the next one refills from empty and its formulas restart from
    the update count at its start (partial update groups are applied at the flush)."""
    order = None
    if schedule == "pb-1f1b":
        schedule, order = "pb", "1f1b"
    if schedule == "2bw":
        M = max(M, S)
        k = M
    pipe, probes, hist = make_pipe(
        S,
        schedule,
        M,
        lambda p: SGD(p, lr=0.05, momentum=0.9),
        checkpoint=checkpoint,
        order=order,
        update_size=k if schedule != "2bw" else None,
    )
    g = torch.Generator().manual_seed(0)
    segments: list[tuple[int, int, int]] = []  # (first global mb, count, updates at start)
    start, count, u0 = 0, 0, 0
    for flush in plan + [True]:
        if count == 0 or not flush:
            pipe.step(torch.randn(M, 3, generator=g), torch.randn(M, 1, generator=g))
            count += M
        if flush:
            pipe.flush()
            segments.append((start, count, u0))
            start += count
            u0 = pipe.stages[0].updates
            count = 0
    assert len(set(pipe.stats()["updates"])) == 1
    got = reads(probes)
    for first, n_mb, base in segments:
        for s in range(S):
            for i in range(n_mb):
                n = first + i
                tF, tB, upd = expected(schedule, order, S, M, k, s, i)
                rec = pipe.stages[s].records[n]
                assert (rec["t_F"], rec["update"]) == (base + tF, base + upd), (s, n)
                (wf,) = got[(s, n, "F")]
                (wb,) = got[(s, n, "B")]
                assert torch.equal(wf, hist.w[s][base + tF])
                want_b = hist.w[s][base + (tF if schedule in STASHED else tB)]
                torch.testing.assert_close(wb, want_b, rtol=0, atol=0)
        assert all(len(stage.stash) == 0 and stage.store.versions_held == 1 for stage in pipe.stages)
