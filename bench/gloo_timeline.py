"""Where a gloo pipeline step's time goes, engine vs torch.distributed.pipelining: every rank's
main-thread CPU by kind of work, and how long each message hop takes between two stages.

Run (launches itself under torchrun, one process per stage; rank 0 prints):

    python3 bench/gloo_timeline.py --ranks 4 --side engine
    python3 bench/gloo_timeline.py --ranks 4 --side torch

Same model, data and optimizer as ``bench/pipeline_gloo.py`` (its runners). Over ``--steps``
steps after one warm-up block, each rank records the wall-clock start and end of its stage's
forward, backward and optimizer step (the engine's ``Stage.forward/backward/update``; torch's
``forward_one_chunk``/``backward_one_chunk`` and ``opt.step``) and the thread CPU they take;
``rest`` is the main thread's CPU outside them (communication, bookkeeping, the step's own
overhead). The clocks are one machine's monotonic clock, so rank 0 can subtract the ranks'
timestamps (one host only). A *hop* is the time from the end of a micro-batch's forward on
stage s to the start of its forward on stage s+1 (activations), or from the end of its backward
on s+1 to the start of its backward on s (gradients): the message's latency plus whatever the
receiver was still doing. Micro-batch 0's activation hop is the step boundary: the receiving
rank must have finished its previous step (verdict, update, the step's return and entry).

Not a speed goal (no ratio): a diagnostic for the goal ``pipeline_gloo.py`` checks
(bench/README.md, "The step boundary").
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import under_torchrun  # noqa: E402
from pipeline_gloo import EngineRunner, TorchRunner, data  # noqa: E402

#: one record: (kind "F" | "B" | "U", wall start, wall end, thread CPU seconds)
Event = tuple[str, float, float, float]


class Recorder:
    """Wraps methods so that each call appends an :data:`Event` while ``on``."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.on = False

    def wrap(self, owner: Any, name: str, kind: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append((kind, t0, time.perf_counter(), time.thread_time() - c0))

        setattr(owner, name, timed)


def by_step(events: list[Event]) -> list[list[Event]]:
    """A rank's events cut after each optimizer step (U)."""
    out: list[list[Event]] = []
    cur: list[Event] = []
    for e in events:
        cur.append(e)
        if e[0] == "U":
            out.append(cur)
            cur = []
    return out


def hops(per_rank: list[list[Event]], M: int, skip: int = 1) -> dict[str, list[float | None]]:
    """Median hop latencies in ms (module docstring), one per stage pair s, s+1 (None: no
    sample):
    ``act0`` micro-batch 0's activation, ``act`` the others', ``grad`` every gradient but the
    last, ``grad_last`` the last micro-batch's. One stage per rank, ``M`` micro-batches a
    step; the first ``skip`` steps and the last are left out."""
    steps = [by_step(ev) for ev in per_rank]
    n = min(len(s) for s in steps)
    S = len(per_rank)
    out: dict[str, list[list[float]]] = {k: [[] for _ in range(S - 1)] for k in ("act0", "act", "grad", "grad_last")}
    for k in range(skip, n - 1):
        for s in range(S - 1):
            f_here = [e for e in steps[s][k] if e[0] == "F"]
            f_next = [e for e in steps[s + 1][k] if e[0] == "F"]
            b_here = [e for e in steps[s][k] if e[0] == "B"]
            b_next = [e for e in steps[s + 1][k] if e[0] == "B"]
            for m in range(M):
                out["act0" if m == 0 else "act"][s].append(f_next[m][1] - f_here[m][2])
                out["grad_last" if m == M - 1 else "grad"][s].append(b_here[m][1] - b_next[m][2])
    return {k: [1e3 * statistics.median(x) if x else None for x in v] for k, v in out.items()}


def cpu_split(events: list[Event], total: float, steps: int) -> dict[str, float]:
    """ms of main-thread CPU per step: forward, backward, update and the rest."""
    got = {k: 1e3 * sum(e[3] for e in events if e[0] == k) / steps for k in ("F", "B", "U")}
    got["rest"] = 1e3 * total / steps - sum(got.values())
    return got


def _runner(side: str, S: int, args: argparse.Namespace, rec: Recorder) -> Any:
    if side == "engine":
        from engine.runtime.stage.stage import Stage

        for name, kind in (("forward", "F"), ("backward", "B"), ("update", "U")):
            rec.wrap(Stage, name, kind)
        return EngineRunner(args.schedule, S, args.chunks, args.width, args.layers, 120.0)
    from torch.distributed.pipelining import stage as ts

    rec.wrap(ts._PipelineStageBase, "forward_one_chunk", "F")
    rec.wrap(ts._PipelineStageBase, "backward_one_chunk", "B")
    torch_name = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}[args.schedule]
    runner = TorchRunner(torch_name, S, args.chunks, args.width, args.layers)
    rec.wrap(runner.opt, "step", "U")
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--side", choices=["engine", "torch"], default="engine")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    under_torchrun(args.ranks, __file__)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    S, rank = dist.get_world_size(), dist.get_rank()
    rec = Recorder()
    runner = _runner(args.side, S, args, rec)
    batches = data(args.steps, args.chunks * args.micro_batch, args.width)
    runner.run(batches[:3])
    dist.barrier()
    rec.on = True
    c0, t0 = time.thread_time(), time.perf_counter()
    runner.run(batches)
    c1, t1 = time.thread_time(), time.perf_counter()
    rec.on = False
    gathered: list[Any] = [None] * S
    dist.all_gather_object(gathered, (rec.events, c1 - c0))
    if rank == 0:
        print(f"{args.side} {args.schedule}: {1e3 * (t1 - t0) / args.steps:.2f} ms/step (rank 0's wall)")
        for r, (events, cpu) in enumerate(gathered):
            split = cpu_split(events, cpu, args.steps)
            print(f"  rank {r} main-thread CPU {1e3 * cpu / args.steps:.2f} ms/step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
        got = hops([ev for ev, _ in gathered], args.chunks)
        fmt: Callable[[list[float | None]], str] = lambda v: " ".join("-" if x is None else f"{x:.2f}" for x in v)
        for key, what in (("act0", "activation hop, micro-batch 0 (the step boundary)"),
                          ("act", "activation hop, the others"),
                          ("grad", "gradient hop, all but the last"),
                          ("grad_last", "gradient hop, the last micro-batch")):
            print(f"  {what}, between stages s and s+1 (ms): {fmt(got[key])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
