"""bench/lm_gpu.py on the CPU (its --dry-run: tiny sizes, every captured side as its eager
twin): the script runs end to end and writes the ratio CSV with tokens/s, memory and goals;
one engine step is the loop's step (the same math, so the GPU ratios price the runtime);
the stage cut, the device name in the CSV's name, the torch.compile budget and a failing
side are handled as documented."""

from __future__ import annotations

import csv
import itertools
import json
import signal
import time
from pathlib import Path

import pytest
import torch
from bench_support import load_bench

bench = load_bench("lm_gpu")
harness = load_bench("harness")

CPU = torch.device("cpu")
SMALL = ["--d", "16", "--heads", "2", "--seq", "8", "--vocab", "32"]
TINY = bench.LM(d=16, heads=2, layers=2, seq=8, vocab=32, batch=1)


def test_the_dry_run_writes_every_pair_with_tokens_memory_and_goals(tmp_path: Path, capsys) -> None:
    assert bench.main(["--dry-run", "--out", str(tmp_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED torch.compile: not on a GPU" in out  # the reason, printed
    assert "goal <= 1.05x" in out and "goal <= 1.0x" in out
    (path,) = tmp_path.iterdir()
    assert path.name == "lm_gpu-cpu.csv"
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == harness.RATIO_COLUMNS
        rows = list(reader)
    assert [(r["candidate"], r["peer"]) for r in rows] == [
        ("engine 1f1b eager", "plain loop eager"), ("engine gpipe eager", "plain loop eager"),
        ("engine pb eager batch 1, SC+LWP", "per-sample loop eager")]
    for r in rows:
        assert r["device"].startswith("cpu") and r["torch"] == torch.__version__ and r["date"]
        assert r["benchmark"] == "lm_gpu" and int(r["rounds"]) == 3
        extra = json.loads(r["extra"])
        assert extra["d"] == 16 and extra["layers"] == 2 and extra["balance"] == "1/1/1/1"
        assert extra["candidate_tokens_per_s"] > 0 and extra["peer_tokens_per_s"] > 0
        assert extra["candidate_peak_mib"] is None and extra["memory_ratio"] is None  # no GPU
    sync, pb = [json.loads(r["extra"]) for r in rows[:2]], json.loads(rows[2]["extra"])
    assert all(e["goal_time_ratio"] == 1.05 and e["goal_memory_ratio"] == 1.1 for e in sync)
    assert all(e["candidate_tokens_per_call"] == 8 * 1 * 8 for e in sync)  # M x batch x seq
    assert pb["goal_time_ratio"] == 1.0 and "goal_memory_ratio" not in pb
    assert pb["candidate_tokens_per_call"] == pb["peer_tokens_per_call"] == 8 * 8
    assert [json.loads(r["extra"])["part"] for r in rows] == ["sync", "sync", "pb"]


@pytest.mark.parametrize("hyper", [None, (1.0, 1.0)], ids=["bench", "lr1-eps1"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_engine_step_is_the_loops_step(schedule: str, hyper, monkeypatch) -> None:
    """bf16 autocast, AdamW, M micro-batches of loss/M, the tied head: the engine's step
    leaves the weights the accumulation loop leaves (up to the rounding order of the tied
    weight's two gradients). AdamW's step hardly depends on the gradients' scale; with lr 1
    and eps 1 it does, so a loss scaled otherwise on one side fails here."""
    if hyper is not None:
        monkeypatch.setattr(bench, "LR", hyper[0])
        monkeypatch.setattr(bench, "EPS", hyper[1])
    x, y = bench.batches(TINY, TINY.batch * TINY.chunks, CPU, seed=1)[0]
    pipe = bench.pipeline(TINY, schedule, CPU, captured=False)
    net = TINY.model()
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    loop = bench.AccumulationLoop(net, x, y, TINY.chunks, graph=False)
    pipe.step(x, y)
    loop(x, y)
    ours = {n: p for st in pipe.stages for n, p in st.module.named_parameters()}
    theirs = dict(net.named_parameters(remove_duplicate=False))  # the head's name too
    assert set(ours) == set(theirs) and len(ours) == len(start) + 1  # the head's tied copy
    for name, p in ours.items():
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(not torch.equal(p, start[n]) for n, p in net.named_parameters())


def test_the_cut_minimises_the_largest_stage() -> None:
    assert bench.LM().balance() == [5, 4, 4, 1]  # GPT-2 small: the head is ~5 blocks' FLOPs
    assert bench.min_max_balance([1.0] * 4, 4) == [1, 1, 1, 1]
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True))
               for cuts in itertools.combinations(range(1, len(costs)), 2))
    got = bench.min_max_balance(costs, 3)
    assert sum(got) == len(costs) and min(got) >= 1
    edges = list(itertools.accumulate(got))
    assert max(sum(costs[a:b]) for a, b in zip([0, *edges[:-1]], edges, strict=True)) == best
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5 stages"):
        bench.min_max_balance([1.0] * 4, 5)


def test_the_csv_is_named_for_the_device(monkeypatch) -> None:
    assert bench.device_slug(CPU) == "cpu"
    cuda = torch.device("cuda")  # device_slug reads the name only
    for name, slug in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                       ("NVIDIA A100-SXM4-80GB", "a100"), ("Some Card", "some-card")):
        monkeypatch.setattr(bench, "device_name", lambda _d, n=name: n)
        assert bench.device_slug(cuda) == slug


def test_the_compile_budget_interrupts_a_slow_build() -> None:
    t0 = time.perf_counter()
    with pytest.raises(bench.CompileBudgetExceeded, match="--compile-budget 0.1 s"):
        with bench.time_limit(0.1):
            while time.perf_counter() - t0 < 30:
                time.sleep(0.01)
    assert time.perf_counter() - t0 < 10
    with bench.time_limit(5.0):  # a fast block is untouched, and the timer is cancelled
        pass
    time.sleep(0.05)
    # an alarm set outside (a test timeout) is kept, less the time spent inside
    fired: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda sig, _f: fired.append(sig))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with bench.time_limit(5.0):
            time.sleep(0.1)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.2 + 0.05
        time.sleep(0.5)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _SlowCompile(torch.nn.Module):
    """Stands in for a torch.compile that takes longer than its budget."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *args: object) -> object:
        time.sleep(30)
        return self.net(*args)


def test_a_compile_over_budget_is_skipped_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr(bench.torch, "compile", _SlowCompile)
    lines: list[str] = []
    t0 = time.perf_counter()
    r = bench.run(CPU, TINY, parts=["compile"], rounds=1, warmup=0, min_time=0.0,
                  compile_mode="on", compile_budget=0.2, log=lines.append)
    assert time.perf_counter() - t0 < 20
    assert r.rows == [] and r.failures == {}
    assert "did not build within --compile-budget 0.2 s" in r.skipped["compiled loop"]
    assert any(line.startswith("SKIPPED compiled loop") for line in lines)
    assert r.sides == {}  # nothing else was built for pairs that cannot run


def test_a_failing_side_is_reported_and_the_run_goes_on(monkeypatch, tmp_path: Path,
                                                        capsys) -> None:
    real = bench.pipeline

    def broken(cfg, schedule, device, *, captured):
        if schedule == "pb":
            raise RuntimeError("pb broke")
        return real(cfg, schedule, device, captured=captured)

    monkeypatch.setattr(bench, "pipeline", broken)
    assert bench.main(["--dry-run", "--parts", "pb", "--out", str(tmp_path), *SMALL]) == 1
    out = capsys.readouterr().out
    assert "FAILED pb: RuntimeError: pb broke" in out
    assert "no pair measured; nothing written" in out and not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,words", [
    (["--d", "30", "--heads", "4"], "--d 30 must be a multiple of --heads 4"),
    (["--seq", "0"], "--seq 0 must be >= 1"),
    (["--parts", "mlp"], "invalid choice: 'mlp'"),
])
def test_bad_sizes_are_refused_by_name(args: list[str], words: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--out", str(tmp_path), *args])
    assert exc.value.code == 2 and words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CLI measures on a GPU")
def test_without_a_gpu_the_default_run_writes_nothing(tmp_path: Path, capsys) -> None:
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


TINY_CUDA = bench.LM(d=64, heads=4, layers=2, seq=32, vocab=128, batch=2)


@pytest.mark.cuda
def test_cuda_every_side_is_captured_and_measured() -> None:
    """The GPU path at tiny sizes before the benchmark step: every engine side replays from
    its graph, the loops are graphed, peak memory is measured, nothing fails."""
    r = bench.run(torch.device("cuda"), TINY_CUDA, parts=["sync", "pb"], rounds=1, warmup=0,
                  min_time=0.0, log=lambda _: None)
    assert r.failures == {}
    assert [(row.candidate, row.peer) for row in r.rows] == [
        ("engine 1f1b captured", "plain loop captured"),
        ("engine gpipe captured", "plain loop captured"),
        ("engine pb captured batch 1, SC+LWP", "per-sample loop graphed")]
    for row in r.rows:
        assert row.extra["candidate_peak_mib"] > 0 and row.extra["peer_peak_mib"] > 0
        assert row.extra["candidate_replays"] >= 1
    assert r.rows[2].extra["candidate_stage_streams"] is True  # the default for captured pb


@pytest.mark.cuda
def test_cuda_a_replay_of_the_captured_loop_is_an_eager_step() -> None:
    """The peer of the synchronous ratios: one replay trains as one eager step of the same
    loop from the same weights and AdamW state (its warm-up at capture trains too)."""
    import copy

    dev = torch.device("cuda")
    x, y = bench.batches(TINY_CUDA, TINY_CUDA.batch * TINY_CUDA.chunks, dev, seed=1)[0]
    loop = bench.AccumulationLoop(TINY_CUDA.model().to(dev), x, y, TINY_CUDA.chunks, graph=True)
    torch.cuda.synchronize()
    ref_net = TINY_CUDA.model().to(dev)
    ref_net.load_state_dict(loop.net.state_dict())
    ref = bench.AccumulationLoop(ref_net, x, y, TINY_CUDA.chunks, graph=False)
    ref.opt.load_state_dict(copy.deepcopy(loop.opt.state_dict()))
    x2, y2 = bench.batches(TINY_CUDA, TINY_CUDA.batch * TINY_CUDA.chunks, dev, seed=5)[0]
    loop(x2, y2)
    ref(x2, y2)
    torch.cuda.synchronize()
    for a, b in zip(loop.net.parameters(), ref_net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pb"])
def test_the_captured_engine_sides_replay_on_the_cpu_twins(schedule: str, monkeypatch) -> None:
    """The GPU path's engine sides -- bf16 autocast, the tied head, (h, mask) between stages,
    ``cuda_graphs="program"`` -- capture and replay within the warm-up steps the benchmark
    gives them, on the CPU stand-ins for CUDA graphs (a recording twin for the synchronous
    step, a tape twin for pb's window). engine.optim's CPU reference path reads Adam's step
    count on the host unless ``capturable=True`` (its fused CUDA kernels never do), so the
    test asks for that."""
    from engine.runtime.capture.synchronous import use_backend
    from engine.runtime.capture.audit import _reference_optimizer
    from engine.runtime.capture.graph_twin import RecordingTwin, TapeTwin

    real = bench.engine_adamw
    monkeypatch.setattr(bench, "engine_adamw", lambda **kw: real(capturable=True, **kw))
    pb = schedule == "pb"
    twin = TapeTwin() if pb else RecordingTwin()
    data = bench.batches(TINY, TINY.chunks * (1 if pb else TINY.batch), CPU, seed=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny tensors: more threads only spin)
    try:
        with use_backend(twin), _reference_optimizer():
            pipe = bench.pipeline(TINY, schedule, CPU, captured=True)
            go = bench.cycling(pipe.step, data)
            for _ in range(bench.WARM_STEPS["pb" if pb else "sync", True]):
                go()
            assert bench.check_replaying(pipe, schedule)["replays"] >= 1
    finally:
        torch.set_num_threads(threads)
    assert twin.captures >= 1 and twin.replays >= 1
