"""Runtime overhead of engine.Pipeline against hand-written loops doing the same math.

One process, ``transport="local"``, CPU, one thread. Every case is a paired, alternating
measurement through bench/harness.py (median time ratio engine/peer with a 95 % bootstrap
interval), and before timing, where the math is identical, engine and peer are run on the
same data from the same initial weights and must end with the same weights -- so the peer
provably does the work the engine does, no more and no less.

Cases (``--cases``; the targets are those of the runtime rewrite, this script only measures):

* ``tiny-gpipe``, ``tiny-1f1b``, ``tiny-pb``: an overhead-bound model, S=8 stages of
  Linear(16, 16)+Tanh, batch 16, M=8, momentum SGD, ``checkpoint="never"``; peers: all
  forwards / all backwards / a step per stage (gpipe), forward+backward per micro-batch with
  accumulation (1f1b, same math), and a dataflow tick loop with live weights and one update
  per micro-batch per stage (pb, update_size 1, delays 2(S-1-s)). Target <= 1.25x.
* ``pb-batch1``: engine.demo.models.residual_mlp(64, 10, layers=16, width=64) in 8 stages of 2
  layers, one sample per micro-batch, M=8, SGD + spike compensation + linear weight
  prediction (pb, lwp), against a plain per-sample loop over the unsplit model with
  torch.optim.SGD (momentum 0.9). Different math (no delay there): the ratio prices what
  pipelined batch-1 training costs over plain batch-1 training in one process. Target <= 1.3x.
* ``dense-1f1b``, ``dense-gpipe``: compute-bound, 8 x (Linear(1024, 1024)+ReLU), batch 64,
  one layer per stage, M=8, momentum SGD, against the unsplit model with the same 8
  accumulated micro-batches and one torch.optim.SGD step. Minor page faults per step are
  recorded for both. Target <= 1.05x with zero page faults per step.
* ``pb-batch1-sc``, ``pb-batch1-plain`` (diagnostic, only with ``--cases``): pb-batch1 with
  spike compensation only, and with plain momentum SGD: what each mitigation adds.
* ``pb-batch1-cpu-loop`` (diagnostic): pb-batch1 with engine.optim's fused CPU loop against
  the same pipeline on the reference path (``PE_CPU_LOOP=0``); same math, bitwise equal.

    python bench/overhead.py --out /tmp/overhead              # all cases, 21 rounds
    python bench/overhead.py --quick --cases tiny-gpipe --out /tmp/o   # smoke run

Pipeline construction for each case lives in ONE function (``*_pipeline`` below), so a
renamed runtime keyword is a one-line change.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    MinorFaults,
    RatioRow,
    paired,
    summary_line,
    write_ratio_csv,
)
from outputs import DEFAULT_OUT  # noqa: E402
from overhead_peers import (  # noqa: E402
    GPipeLoop,
    MicroBatchLoop,
    PBTickLoop,
    PerSampleLoop,
)

import engine  # noqa: E402
import engine.demo.models  # noqa: E402  (not among engine's lazy attributes)
from engine.optim import cpu_loop  # noqa: E402

S = 8
M = 8
LR, MOMENTUM = 1e-2, 0.9
PB1_LR = 1e-3
POOL = 16  # mini-batches of data each side cycles through (generated before timing)

Step = Callable[[], object]


# ---------------------------------------------------------------- engine pipelines (one per case)


def tiny_pipeline(stages: list[nn.Module], schedule: str) -> engine.Pipeline:
    return engine.Pipeline(
        stages, schedule=schedule, chunks=M, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(p, lr=LR, momentum=MOMENTUM),
        checkpoint="never", update_size=1 if schedule == "pb" else None,
    )


#: pb-batch1's mitigations: the target case and the two diagnostic steps below it
PB1_MITIGATIONS = {
    "sc+lwp": ({"spike_compensation": True, "prediction": "linear"}, {"weight_prediction": "lwp"}),
    "sc": ({"spike_compensation": True}, {}),
    "plain": ({}, {}),
}


def pb_batch1_pipeline(stages: list[nn.Module], mitigations: str = "sc+lwp") -> engine.Pipeline:
    opt_kw, pipe_kw = PB1_MITIGATIONS[mitigations]
    return engine.Pipeline(
        stages, schedule="pb", chunks=M, loss_fn=F.cross_entropy,
        optimizer=lambda p: engine.optim.SGD(p, lr=PB1_LR, momentum=MOMENTUM, **opt_kw),
        checkpoint="never", **pipe_kw,
    )


def dense_pipeline(stages: list[nn.Module], schedule: str) -> engine.Pipeline:
    return engine.Pipeline(
        stages, schedule=schedule, chunks=M, loss_fn=F.mse_loss,
        optimizer=lambda p: engine.optim.SGD(p, lr=LR, momentum=MOMENTUM),
        checkpoint="never",
    )


# ---------------------------------------------------------------- models and data


def tiny_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(S)]


def dense_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(S)]


def residual_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    model = engine.demo.models.residual_mlp(64, 10, layers=16, width=64)
    layers, out, start = list(model.children()), [], 0
    for count in engine.demo.models.even_balance(16, S):
        out.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return out


def regression_data(batch: int, width: int, count: int = POOL) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(count)]


def digits_data(count: int = POOL) -> list[tuple[Tensor, Tensor]]:
    """Digits-like: 64 features, 10 classes, one sample per micro-batch; random, so the
    loss stays near log(10) and never diverges however long the benchmark runs."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(M, 64, generator=g), torch.randint(0, 10, (M,), generator=g))
            for _ in range(count)]


def stepper(fn: Callable[[Tensor, Tensor], object], data: Sequence[tuple[Tensor, Tensor]]) -> Step:
    """A zero-argument call that trains on the next mini-batch of the (cycled) pool."""
    it: Iterator[tuple[Tensor, Tensor]] = itertools.cycle(data)

    def step() -> object:
        x, y = next(it)
        return fn(x, y)

    return step


def compare_weights(engine_modules: Sequence[nn.Module], peer_modules: Sequence[nn.Module], case: str) -> str:
    """'bitwise equal' or 'allclose (max |diff| ...)'; raises naming the first tensor that
    differs beyond float-reordering tolerance."""
    ours = [(f"stage {s} {n}", p) for s, m in enumerate(engine_modules) for n, p in m.named_parameters()]
    theirs = [p for m in peer_modules for p in m.parameters()]
    if len(ours) != len(theirs):
        raise AssertionError(f"{case}: engine has {len(ours)} parameters, the peer {len(theirs)}")
    worst = 0.0
    for (name, a), b in zip(ours, theirs, strict=True):
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise AssertionError(
                f"{case}: engine and peer weights differ at {name} (max |diff| "
                f"{(a - b).abs().max().item():.3g}); the peer does not do the engine's math"
            )
        worst = max(worst, (a - b).abs().max().item())
    return "bitwise equal" if worst == 0.0 else f"allclose (max |diff| {worst:.2g})"


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    """A benchmark case: fresh (engine, peer) steps, and the pre-timing equality check."""

    name: str
    title: str
    candidate: str
    peer: str
    target: float
    build: Callable[[], tuple[Step, Step]]
    check: Callable[[], str]


def _sync_peer(schedule: str, modules: list[nn.Module], loss_fn: Callable[..., Tensor],
               unsplit: bool) -> Callable[[Tensor, Tensor], object]:
    opt = lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM)  # noqa: E731
    if unsplit:
        return MicroBatchLoop([nn.Sequential(*modules)], M, loss_fn, opt)
    if schedule == "gpipe":
        return GPipeLoop(modules, M, loss_fn, opt)
    return MicroBatchLoop(modules, M, loss_fn, opt)


def _check_same_weights(case: str, make_stages: Callable[[], list[nn.Module]],
                        make_pipe: Callable[[list[nn.Module]], engine.Pipeline],
                        make_peer: Callable[[list[nn.Module]], Callable[[Tensor, Tensor], object]],
                        data: Sequence[tuple[Tensor, Tensor]], steps: int, flush: bool) -> str:
    ours = make_stages()
    theirs = copy.deepcopy(ours)
    pipe, peer = make_pipe(ours), make_peer(theirs)
    for x, y in data[:steps]:
        pipe.step(x, y)
        peer(x, y)
    if flush:
        pipe.flush()
        peer.flush()  # type: ignore[attr-defined]
    # the modules handed to the Pipeline hold its live weights (DESIGN: parameters are views)
    return compare_weights(ours, theirs, case)


def tiny_case(schedule: str) -> Case:
    data = regression_data(16, 16)

    def make_peer(stages: list[nn.Module]) -> Callable[[Tensor, Tensor], object]:
        if schedule == "pb":
            return PBTickLoop(stages, M, F.mse_loss, LR, MOMENTUM)
        return _sync_peer(schedule, stages, F.mse_loss, unsplit=False)

    def build() -> tuple[Step, Step]:
        return (stepper(tiny_pipeline(tiny_stages(), schedule).step, data),
                stepper(make_peer(tiny_stages()), data))

    def check() -> str:
        steps = 4 if schedule == "pb" else 3  # pb: more than the 2(S-1) fill ticks
        return _check_same_weights(f"tiny-{schedule}", tiny_stages,
                                   lambda st: tiny_pipeline(st, schedule), make_peer, data,
                                   steps, flush=schedule == "pb")

    peer = {"gpipe": "all-F/all-B loop", "1f1b": "per-micro-batch F+B loop",
            "pb": "dataflow tick loop"}[schedule]
    return Case(f"tiny-{schedule}", f"tiny S=8 M=8 {schedule}", f"engine {schedule}",
                peer, 1.25, build, check)


def pb_batch1_case(mitigations: str = "sc+lwp") -> Case:
    data = digits_data()

    def build() -> tuple[Step, Step]:
        torch.manual_seed(0)
        model = engine.demo.models.residual_mlp(64, 10, layers=16, width=64)
        opt = torch.optim.SGD(model.parameters(), lr=PB1_LR, momentum=MOMENTUM)
        return (stepper(pb_batch1_pipeline(residual_stages(), mitigations).step, data),
                stepper(PerSampleLoop(model, M, F.cross_entropy, opt), data))

    def check() -> str:
        pipe = pb_batch1_pipeline(residual_stages(), mitigations)
        losses = [float(pipe.step(x, y)) for x, y in data[:4]]
        if not all(torch.isfinite(torch.tensor(losses))):
            raise AssertionError(f"pb-batch1: engine losses {losses} are not finite")
        return ("different math by design (plain per-sample SGD, no delay); engine losses "
                f"finite ({losses[-1]:.3f} after 4 steps)")

    name = "pb-batch1" if mitigations == "sc+lwp" else f"pb-batch1-{mitigations}"
    return Case(name, f"pb batch1 S=8 M=8{'' if mitigations == 'sc+lwp' else ' ' + mitigations}",
                "engine sgd" + ("" if mitigations == "plain" else "+" + mitigations),
                "plain per-sample loop", 1.3, build, check)


def _cpu_loop_set(on: bool, step: Step) -> Step:
    """``step`` with engine.optim's fused CPU loop on or off (PE_CPU_LOOP, read every step)."""

    def run() -> object:
        old = os.environ.get(cpu_loop.ENV)
        os.environ[cpu_loop.ENV] = "1" if on else "0"
        try:
            return step()
        finally:
            if old is None:
                del os.environ[cpu_loop.ENV]
            else:
                os.environ[cpu_loop.ENV] = old

    return run


def pb_batch1_loop_case() -> Case:
    data = digits_data()

    def build() -> tuple[Step, Step]:
        return tuple(_cpu_loop_set(on, stepper(pb_batch1_pipeline(residual_stages()).step, data))
                     for on in (True, False))  # type: ignore[return-value]

    def check() -> str:
        stages = [residual_stages(), residual_stages()]
        pipes = [pb_batch1_pipeline(s) for s in stages]
        steps = [_cpu_loop_set(on, stepper(p.step, data[:4])) for on, p in zip((True, False), pipes, strict=True)]
        for _ in range(4):
            for step in steps:
                step()
        loop_calls = sum(st.optimizer.update_paths["cpu_loop"] for st in pipes[0].stages)
        if not cpu_loop.available() or loop_calls == 0:
            raise AssertionError("pb-batch1-cpu-loop: the fused CPU loop never ran (rebuild engine._C)")
        return compare_weights(stages[0], stages[1], "pb-batch1-cpu-loop")

    return Case("pb-batch1-cpu-loop", "pb batch1 S=8 M=8 sc+lwp", "engine, fused CPU loop",
                "engine, reference path", 1.0, build, check)


def dense_case(schedule: str) -> Case:
    data = regression_data(64, 1024, count=4)

    def make_peer(stages: list[nn.Module]) -> Callable[[Tensor, Tensor], object]:
        return _sync_peer(schedule, stages, F.mse_loss, unsplit=True)

    def build() -> tuple[Step, Step]:
        return (stepper(dense_pipeline(dense_stages(), schedule).step, data),
                stepper(make_peer(dense_stages()), data))

    def check() -> str:
        return _check_same_weights(f"dense-{schedule}", dense_stages,
                                   lambda st: dense_pipeline(st, schedule), make_peer, data,
                                   2, flush=False)

    return Case(f"dense-{schedule}", f"dense 8x1024 b64 M=8 {schedule}", f"engine {schedule}",
                "unsplit micro-batch loop", 1.05, build, check)


CASES: dict[str, Callable[[], Case]] = {
    "tiny-gpipe": lambda: tiny_case("gpipe"),
    "tiny-1f1b": lambda: tiny_case("1f1b"),
    "tiny-pb": lambda: tiny_case("pb"),
    "pb-batch1": pb_batch1_case,
    "dense-1f1b": lambda: dense_case("1f1b"),
    "dense-gpipe": lambda: dense_case("gpipe"),
    # diagnostic, not in the default list: what pb-batch1 costs without LWP, without SC
    "pb-batch1-sc": lambda: pb_batch1_case("sc"),
    "pb-batch1-plain": lambda: pb_batch1_case("plain"),
    "pb-batch1-cpu-loop": pb_batch1_loop_case,
}
DEFAULT_CASES = ["tiny-gpipe", "tiny-1f1b", "tiny-pb", "pb-batch1", "dense-1f1b", "dense-gpipe"]


# ---------------------------------------------------------------- driver


def run_case(case: Case, *, rounds: int, warmup: int, min_time: float, label: str) -> RatioRow:
    equality = case.check()
    candidate, peer = case.build()
    res = paired(candidate, peer, rounds=rounds, warmup=warmup, min_time=min_time,
                 probes=[MinorFaults()])
    return res.row("overhead", case.title, case.candidate, case.peer, label=label,
                   note=f"weights check: {equality}", extra={"target": case.target})


def markdown(rows: Sequence[RatioRow]) -> str:
    lines = [
        "| case | engine vs peer | ratio [95% CI] | target | engine ms | peer ms "
        "| minflt/step engine | peer | rounds | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.candidate} vs {r.peer} | {r.median_ratio:.2f}x "
            f"[{r.ci_low:.2f}, {r.ci_high:.2f}] | <= {r.extra['target']:.2f}x "
            f"| {r.candidate_ms:.2f} | {r.peer_ms:.2f} "
            f"| {r.extra['candidate_minflt_per_call']:.0f} | {r.extra['peer_minflt_per_call']:.0f} "
            f"| {r.rounds} | {r.load_before:.1f}->{r.load_after:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="folder for overhead.csv and overhead.md")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma list of cases (default: {', '.join(DEFAULT_CASES)}; "
                    f"also {', '.join(c for c in CASES if c not in DEFAULT_CASES)})")
    ap.add_argument("--rounds", type=int, default=21, help="paired rounds per case")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each side per case")
    ap.add_argument("--min-time", type=float, default=0.1,
                    help="seconds the faster side's timed block lasts (sets calls per block)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, short blocks: a smoke run")
    ap.add_argument("--label", default="", help="machine label for the CSV, e.g. 'CPU, 2 cores'")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    for name in names:
        if name not in CASES:
            ap.error(f"--cases: unknown case {name!r}; choose from {', '.join(CASES)}")
    if args.quick:
        args.rounds, args.warmup, args.min_time = 3, 1, 0.005
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")

    torch.set_num_threads(1)
    rows = []
    for name in names:
        row = run_case(CASES[name](), rounds=args.rounds, warmup=args.warmup,
                       min_time=args.min_time, label=args.label)
        print(summary_line(row), f"(target <= {row.extra['target']:.2f}x; {row.note})", flush=True)
        rows.append(row)
    write_ratio_csv(rows, args.out / "overhead.csv")
    (args.out / "overhead.md").write_text(markdown(rows))
    print()
    print(markdown(rows), end="")
    print(f"wrote {args.out / 'overhead.csv'} and {args.out / 'overhead.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
