"""Whole-step capture on one GPU: engine captured vs engine eager vs a captured plain loop.

The question (issue 23): on a compute-bound synchronous pipeline -- 8 x Linear(4096) (ReLU
between), batch 512 in M=8 micro-batches, one stage per layer on one GPU -- does
``Pipeline(cuda_graphs="program")`` (engine/runtime/exec/capture.py: the whole step, forwards,
backwards and updates, replayed from one CUDA graph) cost what a plain accumulation loop
captured with ``torch.cuda.graph`` costs, and what does it save over the eager engine?

Cases, per schedule (1f1b, gpipe), each a pair measured by bench/harness.py (alternating
paired rounds, median time ratio with a 95 % interval, ``torch.cuda.synchronize`` around
every block), the same mini-batch every call (shapes fixed, so the capture replays):

* engine captured (``cuda_graphs="program"``) vs the captured plain loop;
* engine eager (``cuda_graphs=False``) vs the captured plain loop;
* engine captured vs engine eager.

Both engine sides: engine.optim.SGD(lr=1e-3, momentum=0.9), ``checkpoint="never"``,
``cuda_streams=False`` (program mode runs on one stream), ``on_nonfinite="skip_update"``
(nothing read on the host). The plain loop: the unsplit model, torch.optim.SGD(momentum=0.9),
per step M forwards and backwards of loss/M then ``step()``, captured once after a side-stream
warm-up (PyTorch's whole-network recipe) and replayed after one copy of the batch into its
static input -- the same math as the engine's synchronous step (equal up to rounding order).

    python bench/pipeline_capture_gpu.py --out bench/results        # GPU (~2-4 min on an H100)
    python bench/pipeline_capture_gpu.py --quick --out /tmp/pc      # GPU smoke run

Writes ``pipeline_capture_gpu.csv`` (the ratio schema). Without a CUDA GPU it says so and
exits 0, writing nothing. Never run on a GPU when written (no GPU in that session).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    RatioRow, gpu_ratio_arguments, paired, run_gpu_ratios, summary_line,
)

import engine  # noqa: E402
import engine.optim  # noqa: E402

LR, MOMENTUM = 1e-3, 0.9
SCHEDULES = ("1f1b", "gpipe")


def layers(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    out.append(nn.Linear(width, width))
    return out


def pipeline(schedule: str, mode: object, width: int, depth: int, chunks: int,
             device: torch.device) -> engine.Pipeline:
    return engine.Pipeline(
        [m.to(device) for m in layers(width, depth)], schedule=schedule, chunks=chunks,
        loss_fn=F.mse_loss, checkpoint="never", cuda_streams=False, cuda_graphs=mode,
        on_nonfinite="skip_update",
        optimizer=lambda p: engine.optim.SGD(p, lr=LR, momentum=MOMENTUM),
    )


class GraphedLoop:
    """The plain accumulation loop, captured with torch.cuda.graph (on a GPU) or eager (the
    CPU check of this script): ``loop(x, y)`` trains one mini-batch."""

    def __init__(self, net: nn.Module, x: Tensor, y: Tensor, chunks: int) -> None:
        self.net, self.chunks = net, chunks
        self.opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
        self.x, self.y = x.clone(), y.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if x.device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._body()
            torch.cuda.current_stream().wait_stream(side)
            self.opt.zero_grad(set_to_none=True)  # backward allocates grads in the graph's pool
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._body()

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


def run(device: torch.device, *, width: int = 4096, depth: int = 8, batch: int = 512,
        chunks: int = 8, rounds: int = 15, warmup: int = 3, min_time: float = 0.1,
        label: str = "", log: Callable[[str], None] = print) -> list[RatioRow]:
    """Every pair of every schedule on ``device`` (the CLI refuses without a GPU; tests call
    this on the CPU with a recording twin installed and tiny sizes)."""
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, width, generator=g, device=device)
    y = torch.randn(batch, width, generator=g, device=device)
    where = "one GPU" if device.type == "cuda" else "CPU check"
    rows: list[RatioRow] = []
    for schedule in SCHEDULES:
        sides: dict[str, Callable[[], object]] = {}
        for name, mode in (("captured", "program"), ("eager", False)):
            pipe = pipeline(schedule, mode, width, depth, chunks, device)
            for _ in range(4):  # first step, warm-up, capture, one replay
                pipe.step(x, y)
            sides[name] = (lambda p: lambda: p.step(x, y))(pipe)
            if mode == "program":
                cap = pipe.stats()["capture"]
                if cap["captures"] != 1 or cap["replays"] < 1:
                    raise AssertionError(f"pipeline_capture_gpu {schedule}: not replaying: {cap}")
        net = nn.Sequential(*layers(width, depth)).to(device)
        loop = GraphedLoop(net, x, y, chunks)
        sides["loop"] = lambda: loop(x, y)
        pairs = [("captured", "loop"), ("eager", "loop"), ("captured", "eager")]
        names = {"captured": "engine captured", "eager": "engine eager",
                 "loop": "plain loop " + ("captured" if device.type == "cuda" else "eager")}
        for cand, peer in pairs:
            res = paired(sides[cand], sides[peer], rounds=rounds, warmup=warmup,
                         min_time=min_time, device=device)
            rows.append(res.row(
                "pipeline_capture_gpu",
                f"{schedule} {depth}x Linear({width}) batch {batch} M={chunks} {where}",
                names[cand], names[peer], label=label,
                note="same math up to rounding order (engine: per-stage flat buffers)",
                extra={"schedule": schedule, "width": width, "depth": depth, "batch": batch,
                       "chunks": chunks},
            ))
            log(summary_line(rows[-1]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_ratio_arguments(ap, "pipeline_capture_gpu.csv")
    args = ap.parse_args(argv)
    return run_gpu_ratios(ap, args, "pipeline_capture_gpu", run, quick_min_time=0.02)


if __name__ == "__main__":
    sys.exit(main())
