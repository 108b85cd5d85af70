"""pb at batch 1 on one GPU, captured: engine windows replayed from CUDA graphs vs the plain
per-sample loop, eager and captured (issue 23's first goal).

The question: ``engine.demo.models.residual_mlp(64, 10, layers=16, width=W)`` in 8 stages of 2
layers, one sample per micro-batch, M=8 micro-batches per step, momentum SGD. Does
``Pipeline(schedule="pb", cuda_graphs="program")`` (engine/runtime/capture/asynchronous.py: each
step's window replayed from one graph, carried activations in static rings) cost at most what
PyTorch's whole-network recipe costs for the same samples one at a time (goal: <= 1.0x the
graphed loop, so >= 10x faster than the eager loop), at W = 64, 256 and 1024?

Sides, per width (bench/harness.py: alternating paired rounds, median time ratio with a 95 %
interval, ``torch.cuda.synchronize`` around every block; every side cycles the same 16
mini-batches):

* engine captured: pb, engine.optim.SGD(lr=1e-3, momentum=0.9, spike_compensation=True,
  prediction="linear"), ``weight_prediction="lwp"``, ``checkpoint="never"``,
  ``cuda_streams=False``, ``on_nonfinite="skip_update"``, ``cuda_graphs="program"``; trained
  for 16 steps before timing, and it must be replaying by then;
* engine eager: the same with ``cuda_graphs=False``;
* engine captured with stage streams: ``cuda_streams=True`` as well, so a window's stage
  branches are concurrent inside the graph (issue 23 item 2);
* eager loop: the unsplit model, torch.optim.SGD(momentum=0.9), per sample zero_grad /
  forward / backward / step (bench/overhead_peers.PerSampleLoop);
* graphed loop: the same per-sample step captured once with ``torch.cuda.graph`` after a
  side-stream warm-up (static input and target, grads set to None), then per sample one copy
  of the sample and one replay.

Pairs: captured vs graphed loop, captured vs eager loop, eager engine vs graphed loop, captured
vs eager engine, captured with streams vs graphed loop and vs captured without. Different math by design between the engine (delayed pb with SC + LWP) and
the loops (plain per-sample SGD): the ratios price the runtime, not the algorithm.

    python bench/pipeline_pb_capture_gpu.py --out bench/results     # GPU (~3-5 min, H100)
    python bench/pipeline_pb_capture_gpu.py --quick --out /tmp/pb   # GPU smoke run

Writes ``pipeline_pb_capture_gpu.csv`` (the ratio schema). Without a CUDA GPU it says so and
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
    RatioRow, gpu_ratio_arguments, paired, run_gpu_ratios, summary_line, whole_step_graph,
)
from overhead import MOMENTUM, PB1_LR, PB1_MITIGATIONS, M, S, digits_data, stepper  # noqa: E402
from overhead_peers import PerSampleLoop  # noqa: E402

import engine  # noqa: E402
import engine.demo.models  # noqa: E402
import engine.optim  # noqa: E402

WIDTHS = (64, 256, 1024)
LAYERS, FEATURES, CLASSES = 16, 64, 10


def model(width: int, layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    return engine.demo.models.residual_mlp(FEATURES, CLASSES, layers=layers, width=width)


def pipeline(width: int, mode: object, device: torch.device, layers: int = LAYERS,
             stages: int = S, streams: bool = False) -> engine.Pipeline:
    opt_kw, pipe_kw = PB1_MITIGATIONS["sc+lwp"]
    parts = engine.demo.models.split_layers(model(width, layers), engine.demo.models.even_balance(layers, stages))
    return engine.Pipeline(
        [p.to(device) for p in parts], schedule="pb", chunks=M, loss_fn=F.cross_entropy,
        optimizer=lambda p: engine.optim.SGD(p, lr=PB1_LR, momentum=MOMENTUM, **opt_kw),
        checkpoint="never", cuda_streams=streams, on_nonfinite="skip_update", cuda_graphs=mode,
        **pipe_kw,
    )


class GraphedSampleLoop:
    """Plain per-sample SGD on the unsplit model, each sample's step one CUDA graph replay
    (PyTorch's whole-network recipe); eager on the CPU (this script's CPU check)."""

    def __init__(self, net: nn.Module, x: Tensor, y: Tensor) -> None:
        self.net = net
        self.opt = torch.optim.SGD(net.parameters(), lr=PB1_LR, momentum=MOMENTUM)
        self.x, self.y = x[:1].clone(), y[:1].clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if x.device.type == "cuda":
            self.graph = whole_step_graph(self._body, self.opt)

    def _body(self) -> None:
        F.cross_entropy(self.net(self.x), self.y).backward()
        self.opt.step()

    def __call__(self, x: Tensor, y: Tensor) -> None:
        for k in range(x.shape[0]):
            self.x.copy_(x[k:k + 1])
            self.y.copy_(y[k:k + 1])
            if self.graph is None:
                self.opt.zero_grad(set_to_none=True)
                self._body()
            else:
                self.graph.replay()  # each replay's backward writes the grads afresh


def run(device: torch.device, *, widths: Sequence[int] = WIDTHS, layers: int = LAYERS,
        stages: int = S, rounds: int = 15, warmup: int = 3, min_time: float = 0.1,
        label: str = "", log: Callable[[str], None] = print) -> list[RatioRow]:
    """Every pair at every width on ``device`` (the CLI refuses without a GPU; tests call this
    on the CPU with a tape twin installed and tiny sizes)."""
    data = [(x.to(device), y.to(device)) for x, y in digits_data()]
    where = "one GPU" if device.type == "cuda" else "CPU check"
    rows: list[RatioRow] = []
    for width in widths:
        sides: dict[str, Callable[[], object]] = {}
        engines = [("captured", "program", False), ("eager", False, False)]
        if device.type == "cuda":  # stage streams need a GPU
            engines.append(("captured+streams", "program", True))
        for name, mode, streams in engines:
            pipe = pipeline(width, mode, device, layers, stages, streams)
            go = stepper(pipe.step, data)
            for _ in range(16):  # first steps, learning, the capture, replays
                go()
            if mode == "program":
                cap = pipe.stats()["capture"]
                if cap["captures"] != 1 or cap["replays"] < 1:
                    raise AssertionError(f"pipeline_pb_capture_gpu width {width}: not replaying: {cap}")
            sides[name] = go
        net = model(width, layers).to(device)
        sides["eager loop"] = stepper(PerSampleLoop(
            net, M, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=PB1_LR, momentum=MOMENTUM)), data)
        gnet = model(width, layers).to(device)
        sides["graphed loop"] = stepper(GraphedSampleLoop(gnet, *data[0]), data)
        pairs = [("captured", "graphed loop"), ("captured", "eager loop"), ("eager", "graphed loop"),
                 ("captured", "eager")]
        if "captured+streams" in sides:
            pairs += [("captured+streams", "graphed loop"), ("captured+streams", "captured")]
        names = {"captured": "engine captured", "eager": "engine eager", "eager loop": "per-sample loop eager",
                 "captured+streams": "engine captured, stage streams",
                 "graphed loop": "per-sample loop " + ("graphed" if device.type == "cuda" else "eager")}
        for cand, peer in pairs:
            res = paired(sides[cand], sides[peer], rounds=rounds, warmup=warmup,
                         min_time=min_time, device=device)
            rows.append(res.row(
                "pipeline_pb_capture_gpu",
                f"pb batch1 S={stages} M={M} residual_mlp width {width} {where}",
                names[cand], names[peer], label=label,
                note=("engine: pb + SC + LWP, skip_update; loops: plain per-sample SGD "
                      "(different math by design)"),
                extra={"width": width, "stages": stages, "chunks": M, "layers": layers,
                       "goal_vs_graphed_loop": 1.0},
            ))
            log(summary_line(rows[-1]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_ratio_arguments(ap, "pipeline_pb_capture_gpu.csv")
    args = ap.parse_args(argv)
    return run_gpu_ratios(ap, args, "pipeline_pb_capture_gpu", run, quick_min_time=0.02)


if __name__ == "__main__":
    sys.exit(main())
