"""End-to-end pipeline throughput over gloo: engine vs torch.distributed.pipelining, and async
schedules vs GPipe against the theoretical (M+S-1)/M.

Run under torchrun, one process per stage (rank 0 writes the results):

    torchrun --standalone --nproc-per-node 4 bench/pipeline_gloo.py --out bench/results --label "CPU, 2 cores"

(``python bench/pipeline_gloo.py --out DIR`` launches itself that way, with ``--ranks`` ranks.)

What is compared, in one run on the same machine, the same model (an MLP cut into S equal
stages), the same micro-batches and the same optimizer (SGD with momentum):

* ``engine`` ``gpipe`` / ``1f1b`` vs torch's ``ScheduleGPipe`` / ``Schedule1F1B``
  (``ratio_vs_peer`` = our samples/s over torch's). No activation recomputation on either side.
* ``engine`` ``pipedream`` / ``2bw`` / ``pb`` vs ``engine`` ``gpipe``: ``ratio_vs_peer`` is the
  measured speed-up, ``theory_ratio`` = (M+S-1)/M, the bubble GPipe pays per mini-batch when
  every stage takes the same time and communication is free. Async schedules run T steps
  without flushing, then one flush (inside the timed window).

Timing: each configuration runs ``--steps`` mini-batches after ``--warmup``, bracketed by
barriers; rounds interleave the configurations (so drift hits all alike) and the median round
is reported. On a machine with fewer cores than processes (the CI box: 2 cores, 4 ranks) the
ranks time-share the cores, so the measured speed-ups are bounded by the core count, not by
the schedule; the CSV's ``note`` column says so.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, versions  # noqa: E402


@dataclass
class PipeRow:
    """One throughput measurement (the pipeline analogue of common.Row)."""

    benchmark: str
    provider: str
    schedule: str
    stages: int
    chunks: int
    micro_batch: int
    width: int
    steps: int
    median_step_ms: float
    min_step_ms: float
    max_step_ms: float
    samples_per_s: float
    peer: str
    ratio_vs_peer: float
    theory_ratio: float
    device: str
    label: str
    torch: str
    engine: str
    note: str


def stage_module(s: int, width: int, layers: int) -> nn.Module:
    torch.manual_seed(s)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def data(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
        for _ in range(steps)
    ]


class EngineRunner:
    def __init__(
        self, schedule: str, S: int, M: int, width: int, layers: int, timeout: float
    ) -> None:
        from engine import Pipeline

        s = dist.get_rank()
        self.pipe = Pipeline(
            [lambda i=i: stage_module(i, width, layers) for i in range(S)],
            schedule=schedule,
            chunks=M,
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
            checkpoint="never",
            transport="gloo",
            timeout=timeout,
        )
        self.first, self.last = s == 0, s == S - 1

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.pipe.step(x if self.first else None, y if self.last else None)
        self.pipe.flush()


class TorchRunner:
    """torch.distributed.pipelining with the same stage modules (keyword arguments: they moved
    between torch 2.11 and 2.13, see docs/ENVIRONMENT.md)."""

    def __init__(self, schedule: str, S: int, M: int, width: int, layers: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        s = dist.get_rank()
        self.module = stage_module(s, width, layers)
        stage = PipelineStage(
            submodule=self.module, stage_index=s, num_stages=S, device=torch.device("cpu")
        )
        cls = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[schedule]
        self.schedule = cls(stage, n_microbatches=M, loss_fn=nn.functional.mse_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4, momentum=0.9)
        self.first, self.last = s == 0, s == S - 1

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.opt.zero_grad(set_to_none=True)
            if self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=[])
            else:
                self.schedule.step()
            self.opt.step()


def timed(runner: object, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    runner.run(batches)  # type: ignore[attr-defined]
    dist.barrier()
    return (time.perf_counter() - t0) / len(batches)


def plot(rows: list[PipeRow], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    peers = [r for r in rows if r.benchmark == "vs_torch"]
    names = [f"{r.provider}\n{r.schedule}" for r in peers]
    ax1.bar(names, [r.samples_per_s for r in peers], color=["C0", "C1"] * (len(peers) // 2))
    ax1.set_ylabel("samples / s")
    ax1.set_title("engine vs torch.distributed.pipelining (gloo)")
    ax1.tick_params(axis="x", labelsize=8)
    asyn = [r for r in rows if r.benchmark == "async_vs_gpipe"]
    xs = range(len(asyn))
    ax2.bar([x - 0.2 for x in xs], [r.ratio_vs_peer for r in asyn], width=0.4, label="measured")
    ax2.bar([x + 0.2 for x in xs], [r.theory_ratio for r in asyn], width=0.4, label="(M+S-1)/M")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xticks(list(xs), [r.schedule for r in asyn])
    ax2.set_ylabel("throughput / gpipe")
    ax2.set_title("async schedules vs engine gpipe")
    ax2.legend(loc="lower right")
    fig.suptitle(
        f"S={rows[0].stages}, M={rows[0].chunks}, micro-batch {rows[0].micro_batch}, width {rows[0].width} -- {label}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chunks", type=int, default=8, help="M, micro-batches per mini-batch")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--label", default="", help="machine label for the CSV/plot, e.g. 'CPU, 2 cores'"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument(
        "--ranks", type=int, default=4, help="processes (= stages) when not started by torchrun"
    )
    args = ap.parse_args()
    if "RANK" not in os.environ:
        # started as a plain script (e.g. by .ci/gpu): launch ourselves under torchrun
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(args.ranks), __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    S, rank = dist.get_world_size(), dist.get_rank()
    M, b = args.chunks, args.micro_batch
    batches = data(args.steps, M * b, args.width)
    warm = data(args.warmup, M * b, args.width)

    configs: list[tuple[str, str, object]] = [
        ("engine", "gpipe", EngineRunner("gpipe", S, M, args.width, args.layers, args.timeout)),
        (
            "torch.pipelining",
            "ScheduleGPipe",
            TorchRunner("ScheduleGPipe", S, M, args.width, args.layers),
        ),
        ("engine", "1f1b", EngineRunner("1f1b", S, M, args.width, args.layers, args.timeout)),
        (
            "torch.pipelining",
            "Schedule1F1B",
            TorchRunner("Schedule1F1B", S, M, args.width, args.layers),
        ),
        (
            "engine",
            "pipedream",
            EngineRunner("pipedream", S, M, args.width, args.layers, args.timeout),
        ),
        ("engine", "2bw", EngineRunner("2bw", S, M, args.width, args.layers, args.timeout)),
        ("engine", "pb", EngineRunner("pb", S, M, args.width, args.layers, args.timeout)),
    ]
    for _, _, runner in configs:
        runner.run(warm)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {f"{p}/{s}": [] for p, s, _ in configs}
    for _ in range(args.rounds):
        for p, s, runner in configs:
            times[f"{p}/{s}"].append(timed(runner, batches))
    if rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return

    ver = versions()
    cores = os.cpu_count() or 0
    note = (
        f"{S} ranks on {cores} cores: ranks time-share cores, speed-ups are capped near {cores}x"
        if cores < S
        else ""
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    rows: list[PipeRow] = []

    def row(bench: str, p: str, s: str, peer: str, theory: float) -> PipeRow:
        t = med[f"{p}/{s}"]
        vals = times[f"{p}/{s}"]
        ratio = med[peer] / t if peer else 1.0
        return PipeRow(
            bench,
            p,
            s,
            S,
            M,
            b,
            args.width,
            args.steps,
            t * 1e3,
            min(vals) * 1e3,
            max(vals) * 1e3,
            M * b / t,
            peer,
            ratio,
            theory,
            device_name(torch.device("cpu")),
            args.label,
            ver["torch"],
            ver["engine"],
            note,
        )

    for ours, theirs in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
        rows.append(row("vs_torch", "engine", ours, f"torch.pipelining/{theirs}", 1.0))
        rows.append(row("vs_torch", "torch.pipelining", theirs, "", 1.0))
    for s in ("pipedream", "2bw", "pb"):
        rows.append(row("async_vs_gpipe", "engine", s, "engine/gpipe", (M + S - 1) / M))

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "pipeline_gloo.csv"
    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[f.name for f in fields(PipeRow)])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    plot(rows, args.out / "pipeline_gloo.png", args.label or device_name(torch.device("cpu")))
    for r in rows:
        print(
            f"{r.benchmark:15s} {r.provider:17s} {r.schedule:14s} {r.median_step_ms:8.2f} ms/step "
            f"{r.samples_per_s:9.1f} samples/s  ratio {r.ratio_vs_peer:.3f}"
            + (f" (theory {r.theory_ratio:.3f})" if r.benchmark == "async_vs_gpipe" else "")
        )
    print(f"wrote {csv_path} and {args.out / 'pipeline_gloo.png'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
