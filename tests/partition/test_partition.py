"""Tests for engine.partition: exactness against brute force, memory caps, errors, profiling.

The brute force here is written independently of the module: its own footprint table (from
ALGORITHMS.md), its own exact arithmetic (fractions), and an enumeration of every
composition of n layers into S stages.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from engine.partition import (
    LayerCost,
    balance_model,
    partition,
    profile_layers,
    split_sequential,
    stage_costs,
    stage_footprint,
)
from engine.schedule import analyze, generate

# (schedule, order) pairs the partitioner supports
VARIANTS = [
    ("naive", None),
    ("gpipe", None),
    ("1f1b", None),
    ("pipedream", None),
    ("2bw", None),
    ("pb", None),
    ("pb", "1f1b"),
]


# ----------------------------------------------------------------------------- reference


def ref_footprint(schedule: str, order: str | None, S: int, M: int, s: int) -> tuple[int, int]:
    """(versions, activation micro-batches) at stage s, straight from ALGORITHMS.md."""
    versions = {"pipedream": S - s, "2bw": 2}.get(schedule, 1)
    if schedule == "naive":
        held = 1
    elif schedule == "gpipe":
        held = M
    elif schedule == "1f1b":
        held = min(M, S - s)
    elif schedule == "pb" and order != "1f1b":
        held = 2 * (S - 1 - s) + 1
    else:  # pipedream, 2bw, pb in 1f1b order: async, the pipeline never drains
        held = S - s
    return versions, held


def compositions(n: int, S: int):
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *cuts, n)
        yield [bounds[k + 1] - bounds[k] for k in range(S)]


def ref_stages(costs, balance, schedule, order, M, factor):
    """Exact (time, memory) per stage: time a Fraction, memory whole bytes (rounded up)."""
    S = len(balance)
    out, i = [], 0
    f = Fraction(str(factor))  # factors are read as the decimals they print as
    for s, k in enumerate(balance):
        layer = costs[i : i + k]
        i += k
        t = sum((Fraction(c.forward_time) + Fraction(c.backward_time) for c in layer), Fraction(0))
        P = sum(c.param_bytes for c in layer)
        A = sum(c.activation_bytes for c in layer)
        B = sum(c.buffer_bytes for c in layer)
        v, a = ref_footprint(schedule, order, S, M, s)
        out.append((t, P * (v + 1) + math.ceil(P * f) + B + A * a))
    return out


def brute_force(costs, S, objective, schedule, order, M, factor, cap):
    """(best balance, smallest feasible cap) by enumerating every composition."""
    best_key, best = None, None
    need = None
    for bal in compositions(len(costs), S):
        stages = ref_stages(costs, bal, schedule, order, M, factor)
        tmax = max(t for t, _ in stages)
        mmax = max(m for _, m in stages)
        need = mmax if need is None else min(need, mmax)
        if cap is not None and mmax > cap:
            continue
        key = (tmax, mmax, bal) if objective == "time" else (mmax, tmax, bal)
        if best_key is None or key < best_key:
            best_key, best = key, bal
    return best, need


def cap_from_message(msg: str) -> int:
    m = re.search(r"smallest cap that fits is (\d+) bytes", msg)
    assert m, msg
    return int(m.group(1))


def random_costs(rng: random.Random, n: int, *, ties: bool) -> list[LayerCost]:
    out = []
    for _ in range(n):
        if ties:  # small integers: many equal bottlenecks, exercises the tie-break
            f, b = rng.randint(0, 3), rng.randint(0, 3)
        else:
            f, b = rng.uniform(0, 1e-3), rng.uniform(0, 2e-3)
        out.append(
            LayerCost(
                forward_time=f,
                backward_time=b,
                param_bytes=rng.choice([0, 0, rng.randint(1, 400)]),
                activation_bytes=rng.randint(0, 300),
                buffer_bytes=rng.choice([0, 0, 0, rng.randint(1, 50)]),
            )
        )
    return out


def check_case(costs, S, objective, schedule, order, M, factor, cap):
    expected, need = brute_force(costs, S, objective, schedule, order, M, factor, cap)
    kwargs = dict(
        objective=objective,
        schedule=schedule,
        order=order,
        chunks=M,
        optimizer_state_factor=factor,
        memory_cap_bytes=cap,
    )
    if expected is None:
        with pytest.raises(ValueError, match="smallest cap that fits") as err:
            partition(costs, S, **kwargs)
        assert cap_from_message(str(err.value)) == need
        return
    got = partition(costs, S, **kwargs)
    assert got == expected, (got, expected)
    assert len(got) == S and sum(got) == len(costs) and min(got) >= 1
    computed = stage_costs(
        costs, got, schedule=schedule, order=order, chunks=M, optimizer_state_factor=factor
    )
    ref = ref_stages(costs, got, schedule, order, M, factor)
    assert [c.memory_bytes for c in computed] == [m for _, m in ref]
    if cap is not None:
        assert all(c.memory_bytes <= cap for c in computed)


def random_case(rng: random.Random):
    n = rng.randint(1, 10)
    S = rng.randint(1, min(5, n))
    schedule, order = rng.choice(VARIANTS)
    M = rng.randint(1, 6)
    if schedule == "2bw":
        M = max(M, S)
    factor = rng.choice([0, 1, 2, 1.5, 0.25])
    costs = random_costs(rng, n, ties=rng.random() < 0.5)
    objective = rng.choice(["time", "memory"])
    # caps around the achievable range: sometimes loose, sometimes tight, sometimes infeasible
    mems = sorted(
        max(m for _, m in ref_stages(costs, bal, schedule, order, M, factor))
        for bal in compositions(n, S)
    )
    cap = rng.choice([None, rng.choice(mems), rng.choice(mems) - 1, mems[0] - 1, mems[-1]])
    if cap is not None and cap < 0:  # every split needs 0 bytes: no cap is infeasible (a
        cap = 0  # negative one is a ValueError of its own, test_bad_cap_is_refused)
    return costs, S, objective, schedule, order, M, factor, cap


# ----------------------------------------------------------------------------- footprint


@pytest.mark.parametrize("schedule,order", VARIANTS)
def test_footprint_matches_schedule_analysis(schedule, order):
    """The closed forms agree with what engine.schedule measures by simulation (steady state)."""
    for S in range(1, 6):
        for M in (1, 2, 3, 5):
            if schedule == "2bw" and M < S:
                with pytest.raises(ValueError, match="chunks >= "):
                    stage_footprint(schedule, S, M)
                continue
            steps = -(-(2 * S + 2) // M) + 1  # enough micro-batches to reach steady state
            report = analyze(generate(schedule, S, M, steps=steps, order=order))
            fp = stage_footprint(schedule, S, M, order=order)
            assert [v for v, _ in fp] == list(report.versions), (S, M)
            assert [a for _, a in fp] == list(report.activation_peak), (S, M)
            assert fp == [ref_footprint(schedule, order, S, M, s) for s in range(S)]


# ----------------------------------------------------------------------------- optimality


def test_optimal_vs_brute_force_seeded():
    rng = random.Random(1234)
    seen = set()
    infeasible = 0
    for _ in range(400):
        case = random_case(rng)
        costs, S, objective, schedule, order, M, factor, cap = case
        seen.add((objective, schedule, order))
        if cap is not None and brute_force(*case[:7], cap)[0] is None:
            infeasible += 1
        check_case(*case)
    assert len(seen) == 2 * len(VARIANTS)  # every objective x schedule was exercised
    assert infeasible >= 20


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_optimal_vs_brute_force_hypothesis(seed):
    check_case(*random_case(random.Random(seed)))


@settings(max_examples=100, deadline=None)
@given(
    times=st.lists(st.floats(0, 1, allow_nan=False, allow_subnormal=True), min_size=2, max_size=9),
    S=st.integers(1, 5),
    objective=st.sampled_from(["time", "memory"]),
)
def test_arbitrary_float_times_are_compared_exactly(times, S, objective):
    """Any floats (subnormals, 0.1 + 0.2 vs 0.3, ...) give the brute-force optimum."""
    S = min(S, len(times))
    costs = [LayerCost(t, t / 3, 10 * (k % 3), 7 * k) for k, t in enumerate(times)]
    check_case(costs, S, objective, "1f1b", None, 4, 2, None)


def test_tie_break_is_lexicographically_smallest():
    equal = [LayerCost(1.0, 2.0, 0, 0)] * 5
    assert partition(equal, 2, chunks=1) == [2, 3]
    assert partition(equal, 3, chunks=1) == [1, 2, 2]
    assert partition(equal, 5, chunks=1) == [1] * 5


def test_time_ties_broken_by_memory_and_memory_ties_by_time():
    """Secondary criterion decides between equal bottlenecks, even against lexicographic order."""
    # time objective: [1, 2] and [2, 1] both have bottleneck 2. Under 1F1B with M = 2 stage 0
    # holds 2 micro-batches, stage 1 one: [1, 2] peaks at 50 + 300 = 350 B on stage 1, [2, 1]
    # at max(2 x 50, 300) = 300 B, so [2, 1] wins although [1, 2] is lexicographically first.
    costs = [LayerCost(1, 0, 0, 0), LayerCost(1, 0, 0, 50), LayerCost(1, 0, 0, 300)]
    assert partition(costs, 2, chunks=2, optimizer_state_factor=0) == [2, 1]
    # memory objective: layer 2's 300 B of parameters (600 B with gradients) decide the peak
    # either way; time then decides: [1, 2] takes 1 | 6, [2, 1] takes 2 | 5.
    costs = [LayerCost(1, 0, 0, 0), LayerCost(1, 0, 0, 0), LayerCost(5, 0, 300, 0)]
    assert partition(costs, 2, objective="memory", chunks=1, optimizer_state_factor=0) == [2, 1]
    # and with every criterion tied, the lexicographically smallest balance
    costs = [LayerCost(1, 0, 0, 0), LayerCost(1, 0, 0, 0), LayerCost(1, 0, 300, 0)]
    assert partition(costs, 2, objective="memory", chunks=1, optimizer_state_factor=0) == [1, 2]


# ----------------------------------------------------------------------------- memory


def test_pipedream_versions_change_the_answer():
    """Six identical layers, three stages: 1F1B keeps one version per stage, PipeDream 3, 2, 1."""
    costs = [LayerCost(1.0, 0.0, 100, 0)] * 6
    kw = dict(chunks=4, optimizer_state_factor=0)
    # memory objective: (versions + 1 gradient) x params per stage
    assert partition(costs, 3, objective="memory", schedule="1f1b", **kw) == [2, 2, 2]
    assert partition(costs, 3, objective="memory", schedule="pipedream", **kw) == [1, 2, 3]
    # time objective under a 600 B cap: 1F1B's balanced split fits (400 B per stage), PipeDream's
    # would need 4 x 200 = 800 B on stage 0, so the only fitting split is [1, 2, 3]
    assert partition(costs, 3, schedule="1f1b", memory_cap_bytes=600, **kw) == [2, 2, 2]
    assert partition(costs, 3, schedule="pipedream", memory_cap_bytes=600, **kw) == [1, 2, 3]
    mem = [c.memory_bytes for c in stage_costs(costs, [1, 2, 3], schedule="pipedream", **kw)]
    assert mem == [400, 600, 600]
    assert partition(costs, 3, schedule="pipedream", **kw) == [2, 2, 2]  # no cap: time wins


def test_gpipe_activations_change_the_answer():
    """GPipe holds M micro-batches everywhere; 1F1B holds min(M, S-s): stage 1 can take more."""
    costs = [LayerCost(1.0, 0.0, 0, 100)] * 4
    kw = dict(chunks=8, optimizer_state_factor=0, objective="memory")
    assert partition(costs, 2, schedule="gpipe", **kw) == [2, 2]
    # 1F1B: stage 0 holds 2 micro-batches, stage 1 holds 1: 200a vs 100(4-a) -> a = 1
    assert partition(costs, 2, schedule="1f1b", **kw) == [1, 3]
    # pb dataflow: stage 0 holds 3, stage 1 holds 1
    assert partition(costs, 2, schedule="pb", **kw) == [1, 3]


def test_infeasible_cap_names_smallest_cap_and_stage():
    costs = [LayerCost(1.0, 1.0, 1000, 10)] + [LayerCost(1.0, 1.0, 10, 10)] * 5
    kw = dict(schedule="pipedream", chunks=4, optimizer_state_factor="adam")
    with pytest.raises(ValueError) as err:
        partition(costs, 3, memory_cap_bytes=1000, **kw)
    msg = str(err.value)
    need = cap_from_message(msg)
    # layer 0 alone on stage 0: 1000 x (3 versions + 1 + 2) + 10 x 3 micro-batches
    assert need == 6030
    assert "stage 0 (layer 0)" in msg and "split layer 0" in msg and "memory_cap_bytes=1000" in msg
    for objective in ("time", "memory"):
        bal = partition(costs, 3, memory_cap_bytes=need, objective=objective, **kw)
        assert bal[0] == 1
        assert max(c.memory_bytes for c in stage_costs(costs, bal, **kw)) <= need
        with pytest.raises(ValueError, match=f"smallest cap that fits is {need} bytes"):
            partition(costs, 3, memory_cap_bytes=need - 1, objective=objective, **kw)


def test_optimizer_state_factor():
    costs = [LayerCost(1.0, 0.0, 100, 0)] * 2
    one = dict(chunks=1, schedule="1f1b")
    mem = lambda f: stage_costs(costs, [2], optimizer_state_factor=f, **one)[0].memory_bytes  # noqa: E731
    assert mem(0) == mem("sgd") == 400
    assert mem(1) == mem("momentum") == 600
    assert mem(2) == mem("adam") == mem("AdamW") == 800
    assert mem(0.005) == 401  # ceil(200 * 0.005) = 1 byte: whole bytes, rounded up
    with pytest.raises(ValueError, match="unknown optimizer_state_factor 'lion'"):
        partition(costs, 1, optimizer_state_factor="lion", **one)
    with pytest.raises(ValueError, match=">= 0"):
        partition(costs, 1, optimizer_state_factor=-1, **one)


# ----------------------------------------------------------------------------- errors


def test_partition_errors_teach_the_fix():
    costs = [LayerCost(1.0, 1.0, 1, 1)] * 5
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cannot split 5 layers into 8 stages; use at most 5 stages or split layers"
        ),
    ):
        partition(costs, 8, chunks=1)
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        partition(costs, 0, chunks=1)
    with pytest.raises(TypeError, match="stages must be an int"):
        partition(costs, 2.0, chunks=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown objective 'speed'; use 'time' or 'memory'"):
        partition(costs, 2, chunks=1, objective="speed")
    with pytest.raises(ValueError, match="unknown schedule 'zb'; known schedules: naive, gpipe"):
        partition(costs, 2, chunks=1, schedule="zb")
    with pytest.raises(ValueError, match="2bw.*[Uu]se chunks >= 3"):
        partition(costs, 3, chunks=2, schedule="2bw")
    with pytest.raises(ValueError, match="runs in order 'fill-drain', not '1f1b'; leave order unset"):
        partition(costs, 2, chunks=1, schedule="gpipe", order="1f1b")
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        partition(costs, 2, chunks=0)
    with pytest.raises(ValueError, match="costs is empty"):
        partition([], 1, chunks=1)
    with pytest.raises(ValueError, match=r"costs\[1\].backward_time = -1"):
        partition([costs[0], LayerCost(1.0, -1, 0, 0)], 1, chunks=1)
    with pytest.raises(ValueError, match=r"costs\[0\].param_bytes"):
        partition([LayerCost(1.0, 1.0, 1.5, 0)], 1, chunks=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_cap_bytes must be >= 0"):
        partition(costs, 2, chunks=1, memory_cap_bytes=-5)


def test_split_sequential():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    parts = split_sequential(model, [2, 3])
    assert [len(p) for p in parts] == [2, 3]
    assert parts[1][0] is model[2]  # shared modules, no copies
    assert set(parts[1].state_dict()) == {f"{k}.{w}" for k in (2, 3, 4) for w in ("weight", "bias")}
    x = torch.randn(3, 2)
    torch.testing.assert_close(parts[1](parts[0](x)), model(x))

    with pytest.raises(
        ValueError, match=r"balance \[2, 2\] covers 4 layers but there are 5; add 1"
    ):
        split_sequential(model, [2, 2])
    with pytest.raises(ValueError, match=r"covers 6 layers but there are 5; remove 1"):
        split_sequential(model, [3, 3])
    with pytest.raises(ValueError, match=r"balance\[1\] = 0: stage 1 needs at least one"):
        split_sequential(model, [5, 0])
    with pytest.raises(ValueError, match=r"balance\[0\] = -1"):
        split_sequential(model, [-1, 6])
    with pytest.raises(TypeError, match=r"balance\[2\] = 1.0 is not an int"):
        split_sequential(model, [2, 2, 1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"balance\[0\] = True is not an int"):
        split_sequential(model, [True, 4])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of layer counts"):
        split_sequential(model, "time")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="balance is empty"):
        split_sequential(model, [])
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        split_sequential(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- profiling


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.BatchNorm1d(16),
        nn.Linear(16, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def test_profile_layers_small_mlp():
    model = mlp()
    batch = 12
    x = torch.randn(batch, 8)
    running_mean = model[2].running_mean.clone()
    rng = torch.get_rng_state()
    costs = profile_layers(model, x, repeats=3)
    assert len(costs) == len(model)
    f32 = 4
    assert [c.param_bytes for c in costs] == [
        (8 * 16 + 16) * f32,
        0,
        2 * 16 * f32,
        (16 * 32 + 32) * f32,
        0,
        (32 * 4 + 4) * f32,
    ]
    assert costs[2].buffer_bytes == (16 + 16) * f32 + 8  # running mean, var, num_batches_tracked
    for c in costs:
        assert c.forward_time > 0 and c.backward_time > 0, c
    # Linear saves its input (weights excluded) and keeps its output
    assert costs[0].activation_bytes == batch * (8 + 16) * f32
    assert costs[3].activation_bytes == batch * (16 + 32) * f32
    # ReLU and Tanh save their output, which is also what they return: counted once
    assert costs[1].activation_bytes == batch * 16 * f32
    assert costs[4].activation_bytes == batch * 32 * f32
    assert [c.name for c in costs][:2] == ["0: Linear", "1: ReLU"]
    # profiling left no trace on the model or the RNG
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model[2].running_mean, running_mean)
    assert model[2].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training


def test_profile_layers_errors():
    with pytest.raises(TypeError, match="needs an nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"layer 1 \(1: Split\) returned a tuple"):

        class Split(nn.Module):
            def forward(self, x):
                return x, x

        profile_layers(nn.Sequential(nn.Linear(2, 2), Split()), torch.randn(1, 2), repeats=1)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_layers(mlp(), torch.randn(2, 8), repeats=0)


def test_balance_model_end_to_end():
    model = mlp()
    x = torch.randn(16, 8)
    kw = dict(schedule="pipedream", chunks=4, optimizer_state_factor=1)
    bal = balance_model(model, x, 3, balance="memory", **kw)
    assert len(bal) == 3 and sum(bal) == len(model) and min(bal) >= 1
    costs = profile_layers(model, x, repeats=1)  # bytes do not depend on timing
    best = min(
        max(c.memory_bytes for c in stage_costs(costs, b, **kw))
        for b in compositions(len(model), 3)
    )
    assert max(c.memory_bytes for c in stage_costs(costs, bal, **kw)) == best
    bal_t = balance_model(model, x, 2, balance="time", schedule="1f1b", chunks=2)
    assert len(bal_t) == 2 and sum(bal_t) == len(model)
    parts = split_sequential(model, bal_t)
    torch.testing.assert_close(parts[1](parts[0](x)), model(x))
    assert balance_model(model, x, 2, balance=[1, 5], schedule="1f1b", chunks=2) == [1, 5]
    with pytest.raises(ValueError, match="cannot split 6 layers into 7 stages"):
        balance_model(model, x, 7, schedule="1f1b", chunks=2)
    with pytest.raises(ValueError, match="unknown balance 'speed'"):
        balance_model(model, x, 2, balance="speed", schedule="1f1b", chunks=2)
    with pytest.raises(ValueError, match="smallest cap that fits"):
        balance_model(model, x, 2, balance="time", schedule="1f1b", chunks=2, memory_cap_bytes=10)


@pytest.mark.cuda
def test_profile_layers_on_cuda_moves_layers_back():
    """GPU only (skipped on CPU): CUDA-synchronised timing, layers measured there and returned."""
    model = mlp()
    costs = profile_layers(model, torch.randn(12, 8), device="cuda", repeats=3)
    assert all(c.forward_time > 0 and c.backward_time > 0 for c in costs)
    assert costs[0].param_bytes == (8 * 16 + 16) * 4
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
