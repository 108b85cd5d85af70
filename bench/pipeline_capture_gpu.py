"""Whole-step capture on one GPU: engine captured (one stream or stage streams) vs engine eager
vs a captured plain loop, on a dense model and on a transformer.

The question (issue 23): on compute-bound synchronous pipelines, one stage per layer on one
GPU, M=8 micro-batches, does ``Pipeline(cuda_graphs="program")`` (engine/runtime/exec/
capture.py: the whole step, forwards, backwards and updates, replayed from one CUDA graph)
cost what a plain accumulation loop captured with ``torch.cuda.graph`` costs, what does it save
over the eager engine, and do stage streams inside the graph help a synchronous step?
Goals: at most 1.02x the captured loop on the dense model, 1.05x on the transformer.

Models (``--models``, default both, in this order):

* ``dense``: 8 x Linear(4096), ReLU between, batch 512 (rows named as before this file had
  a second model: ``{schedule} 8x Linear(4096) batch 512 M=8 one GPU``);
* ``transformer``: 8 x nn.TransformerEncoderLayer(1024, nhead=16, dim_feedforward=4096,
  batch_first=True, dropout=0.0), batch 32 x sequence 256 (dropout 0: no random state in the
  capture, and the loop is the same math).

Both take an fp32 input of the output's shape and F.mse_loss against a target of that shape.

Sides, per model and schedule (1f1b, gpipe), the same mini-batch every call (shapes fixed, so
the captures replay); each pair measured by bench/harness.py (alternating paired rounds,
median time ratio with a 95 % interval, ``torch.cuda.synchronize`` around every block):

* engine captured: ``cuda_graphs="program"``, ``cuda_streams=False`` (one stream);
* engine eager: ``cuda_graphs=False``, ``cuda_streams=False``;
* engine captured, stage streams: ``cuda_graphs="program"``, ``cuda_streams=True`` (each
  stage's actions on its own stream inside the graph, an event edge per hand-off; exact since
  Executor.prepare_sync stopped chaining backwards across separate streams);
* plain loop captured: the unsplit model, torch.optim.SGD(momentum=0.9), per step M forwards
  and backwards of loss/M then ``step()``, captured once after a side-stream warm-up
  (PyTorch's whole-network recipe) and replayed after one copy of the batch into its static
  input -- the same math as the engine's synchronous step (equal up to rounding order;
  tests/bench/test_bench_capture_gpu.py checks one step of each on CPU).

Engine sides: engine.optim.SGD(lr=1e-3, momentum=0.9), ``checkpoint="never"``,
``on_nonfinite="skip_update"`` (nothing read on the host); each trained 4 steps before
timing, and a captured side must be replaying by then. Pairs: captured vs loop, eager vs
loop, captured vs eager (the rows of the first version), then stage streams vs loop and
stage streams vs captured. After each model the CSV is rewritten with every row so far, so a
run stopped at its time budget keeps the models it finished.

Cost on one H100 -- an ESTIMATE, not a measurement (2026-11-26, before the transformer case
ever ran): the dense case alone measured well under 60 s at 11 rounds (19.2-21.4 ms a step;
412 GFLOP a step, so ~21 TFLOP/s effective fp32). Transformer, per layer and token:
projections 8 d^2 + feed-forward 16 d^2 + attention 4 * seq * d = 26.2 MFLOP forward at
d = 1024, seq = 256; x 8192 tokens x 3 (forward + backward) x 8 layers = 5.2 TFLOP a step:
~100 ms at 50 TFLOP/s, ~250 ms at the dense case's 21 TFLOP/s. A step of ~min_time (0.1 s)
or more is one call per timed block: per schedule 5 pairs x (2 x 3 warm-up + 6 calibration
+ 2 x rounds) calls + ~16 set-up steps = 186 calls at 11 rounds, 372 for both schedules:
~40-95 s (a step just under 0.1 s gets two calls a block: ~60 s); the dense case, now 10
pairs, ~30-40 s; start-up and captures ~15 s. Whole script: ~85-150 s at 11 rounds (~100-175 s
at 15). Memory: ~100 M parameters (with gradients
and momentum ~1.2 GB per side) and, for gpipe, ~4-5 GB of saved activations per side; sides
of one schedule are freed before the next.

    python bench/pipeline_capture_gpu.py --out bench/results        # GPU, both models
    python bench/pipeline_capture_gpu.py --models transformer --out /tmp/pc
    python bench/pipeline_capture_gpu.py --quick --out /tmp/pc      # GPU smoke run

Writes ``pipeline_capture_gpu.csv`` (the ratio schema). Without a CUDA GPU it says so and
exits 0, writing nothing. The transformer case and the stage-streams side never ran on a GPU
when written (no GPU in that session); on CPU (tests) the stage-streams side runs the
executor's stream path on engine.testing.stream_recorder's recording backend.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    RatioRow, gpu_ratio_arguments, paired, run_gpu_ratios, summary_line, whole_step_graph,
    write_ratio_csv,
)

import engine  # noqa: E402
import engine.optim  # noqa: E402

LR, MOMENTUM = 1e-3, 0.9
SCHEDULES = ("1f1b", "gpipe")
CSV = "pipeline_capture_gpu.csv"
NOTE = "same math up to rounding order (engine: per-stage flat buffers)"


@dataclass(frozen=True)
class Dense:
    """depth x Linear(width), ReLU between; input and target (batch, width)."""

    width: int = 4096
    depth: int = 8
    batch: int = 512
    chunks: int = 8
    name: ClassVar[str] = "dense"
    goal: ClassVar[float] = 1.02  # the bound vs the captured loop

    def layers(self) -> list[nn.Module]:
        torch.manual_seed(0)
        out: list[nn.Module] = [nn.Sequential(nn.Linear(self.width, self.width), nn.ReLU())
                                for _ in range(self.depth - 1)]
        out.append(nn.Linear(self.width, self.width))
        return out

    def shape(self) -> tuple[int, ...]:
        return (self.batch, self.width)

    def case(self, schedule: str, where: str) -> str:
        return (f"{schedule} {self.depth}x Linear({self.width}) batch {self.batch} "
                f"M={self.chunks} {where}")

    def extra(self) -> dict[str, object]:
        return {"width": self.width, "depth": self.depth, "batch": self.batch,
                "chunks": self.chunks}


@dataclass(frozen=True)
class Transformer:
    """depth x TransformerEncoderLayer(d_model, nhead, ffn, batch_first, dropout 0); input
    and target (batch, seq, d_model)."""

    d_model: int = 1024
    nhead: int = 16
    ffn: int = 4096
    depth: int = 8
    batch: int = 32
    seq: int = 256
    chunks: int = 8
    name: ClassVar[str] = "transformer"
    goal: ClassVar[float] = 1.05

    def layers(self) -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.TransformerEncoderLayer(self.d_model, self.nhead, dim_feedforward=self.ffn,
                                           dropout=0.0, batch_first=True)
                for _ in range(self.depth)]

    def shape(self) -> tuple[int, ...]:
        return (self.batch, self.seq, self.d_model)

    def case(self, schedule: str, where: str) -> str:
        return (f"{schedule} {self.depth}x TransformerEncoderLayer({self.d_model}, "
                f"nhead={self.nhead}, ff={self.ffn}) batch {self.batch}x{self.seq} "
                f"M={self.chunks} {where}")

    def extra(self) -> dict[str, object]:
        return {"d_model": self.d_model, "nhead": self.nhead, "ffn": self.ffn, "depth": self.depth,
                "batch": self.batch, "seq": self.seq, "chunks": self.chunks}


Model = Dense | Transformer
MODELS: dict[str, type[Dense] | type[Transformer]] = {"dense": Dense, "transformer": Transformer}


def pipeline(model: Model, schedule: str, mode: object, device: torch.device,
             streams: bool = False) -> engine.Pipeline:
    """The engine side; ``streams``: stage streams (on CPU, the recording stand-in)."""
    pipe = engine.Pipeline(
        [m.to(device) for m in model.layers()], schedule=schedule, chunks=model.chunks,
        loss_fn=F.mse_loss, checkpoint="never", cuda_streams=streams and device.type == "cuda",
        cuda_graphs=mode, on_nonfinite="skip_update",
        optimizer=lambda p: engine.optim.SGD(p, lr=LR, momentum=MOMENTUM),
    )
    if streams and device.type != "cuda":
        from engine.testing.stream_recorder import recording_streams

        recording_streams(pipe)  # the executor's stream path, counted instead of launched
    if pipe.parts.streams.separate != streams:
        raise AssertionError(f"pipeline_capture_gpu {model.name} {schedule}: stage streams "
                             f"{pipe.parts.streams.separate}, wanted {streams}")
    return pipe


class GraphedLoop:
    """The plain accumulation loop, captured with torch.cuda.graph (on a GPU) or eager (the
    CPU check of this script): ``loop(x, y)`` trains one mini-batch."""

    def __init__(self, net: nn.Module, x: Tensor, y: Tensor, chunks: int) -> None:
        self.net, self.chunks = net, chunks
        self.opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        self.x, self.y = x.clone(), y.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if x.device.type == "cuda":
            self.graph = whole_step_graph(self._body, self.opt)

    def _body(self) -> None:
        for xm, ym in zip(self.x.chunk(self.chunks), self.y.chunk(self.chunks), strict=True):
            (F.mse_loss(self.net(xm), ym) / self.chunks).backward()
        self.opt.step()
        if self.graph is None and self.x.device.type != "cuda":
            self.opt.zero_grad(set_to_none=False)

    def __call__(self, x: Tensor, y: Tensor) -> None:
        self.x.copy_(x)
        self.y.copy_(y)
        if self.graph is None:
            self._body()
            return
        # grads were None at capture: each replay's first backward writes them, no zeroing
        self.graph.replay()


# (side, cuda_graphs, stage streams); then the pairs, the first three as in the first version
ENGINE_SIDES = (("captured", "program", False), ("eager", False, False),
                ("captured+streams", "program", True))
PAIRS = (("captured", "loop"), ("eager", "loop"), ("captured", "eager"),
         ("captured+streams", "loop"), ("captured+streams", "captured"))


def run(device: torch.device, *, models: Sequence[Model] = (Dense(), Transformer()),
        rounds: int = 15, warmup: int = 3, min_time: float = 0.1, label: str = "",
        log: Callable[[str], None] = print,
        done: Callable[[list[RatioRow]], None] | None = None) -> list[RatioRow]:
    """Every pair of every schedule and model on ``device`` (the CLI refuses without a GPU;
    tests call this on the CPU with a recording twin installed and tiny sizes). ``done`` gets
    every row so far after each model (the CLI rewrites the CSV)."""
    where = "one GPU" if device.type == "cuda" else "CPU check"
    names = {"captured": "engine captured", "eager": "engine eager",
             "captured+streams": "engine captured, stage streams",
             "loop": "plain loop " + ("captured" if device.type == "cuda" else "eager")}
    rows: list[RatioRow] = []
    for model in models:
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(*model.shape(), generator=g, device=device)
        y = torch.randn(*model.shape(), generator=g, device=device)
        for schedule in SCHEDULES:
            sides: dict[str, Callable[[], object]] = {}
            for name, mode, streams in ENGINE_SIDES:
                pipe = pipeline(model, schedule, mode, device, streams)
                for _ in range(4):  # first step, warm-up, capture, one replay
                    pipe.step(x, y)
                sides[name] = (lambda p: lambda: p.step(x, y))(pipe)
                if mode == "program":
                    cap = pipe.stats()["capture"]
                    if cap["captures"] != 1 or cap["replays"] < 1:
                        raise AssertionError(f"pipeline_capture_gpu {model.name} {schedule} "
                                             f"{name}: not replaying: {cap}")
            net = nn.Sequential(*model.layers()).to(device)
            loop = GraphedLoop(net, x, y, model.chunks)
            sides["loop"] = (lambda f: lambda: f(x, y))(loop)
            for cand, peer in PAIRS:
                res = paired(sides[cand], sides[peer], rounds=rounds, warmup=warmup,
                             min_time=min_time, device=device)
                rows.append(res.row(
                    "pipeline_capture_gpu", model.case(schedule, where), names[cand], names[peer],
                    label=label, note=NOTE,
                    extra={"model": model.name, "schedule": schedule, **model.extra(),
                           "goal_vs_captured_loop": model.goal},
                ))
                log(summary_line(rows[-1]))
            del sides, pipe, net, loop  # free this schedule's graphs and buffers first
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if done is not None:
            done(list(rows))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_ratio_arguments(ap, CSV)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="which models to measure, in this order (default: all)")
    args = ap.parse_args(argv)
    models = [MODELS[m]() for m in dict.fromkeys(args.models)]

    def measure(device: torch.device, **kw: object) -> list[RatioRow]:
        return run(device, models=models, done=lambda rows: write_ratio_csv(rows, args.out / CSV),
                   **kw)  # type: ignore[arg-type]

    return run_gpu_ratios(ap, args, "pipeline_capture_gpu", measure, quick_min_time=0.02)


if __name__ == "__main__":
    sys.exit(main())
