"""What the exception safety of synchronous gloo steps costs: the step's verdict through the
first stage (engine/runtime/ranks/distributed.py, ``relay_verdict``: one more message per step, and
every stage waits for the first stage's end before its update) against the last stage
sending the loss to every stage (``share_loss``, the path before abort frames).

Run (launches itself under torchrun, one process per stage; rank 0 prints):

    python3 bench/step_verdict.py --ranks 4 --rounds 9

Paired in one run, on one pipeline per schedule: before each block every rank switches the
pipeline's verdict path on or off (the same step on every rank), so both sides run the same
weights, data and process group. Below 1: the verdict path is faster.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import under_torchrun  # noqa: E402
from harness import paired, summary_line  # noqa: E402
from pipeline_gloo import EngineRunner, data  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10, help="mini-batches per timed block")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cases", nargs="*", default=["gpipe", "1f1b"])
    args = ap.parse_args()
    under_torchrun(args.ranks, __file__)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    S, rank = dist.get_world_size(), dist.get_rank()
    batches = data(args.steps, args.chunks * args.micro_batch, args.width)
    for case in args.cases:
        runner = EngineRunner(case, S, args.chunks, args.width, args.layers, 60.0)
        ex = runner.pipe.parts.executor
        assert ex.rank.relay, "the verdict path is off for this pipeline"

        def block(relay: bool, runner: EngineRunner = runner, ex: object = ex) -> object:
            def run() -> None:
                ex.rank.relay = ex.runner.aborts = relay  # type: ignore[attr-defined]
                runner.run(batches)

            return run

        res = paired(block(True), block(False), rounds=args.rounds, warmup=1, inner=1,
                     sync=dist.barrier, units_per_call=args.steps)
        row = res.row("step_verdict", case, "verdict via stage 0", "loss from the last stage",
                      label=f"{os.cpu_count()} CPUs", note="")
        if rank == 0:
            print(summary_line(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
