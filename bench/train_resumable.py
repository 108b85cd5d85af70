"""Training that survives a dead rank: torchrun restarts the job, which resumes by itself.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 bench/train_resumable.py \\
        --ckpt /tmp/ckpt --steps 12 --save-every 3

Every rank runs this script. At start the job loads the last *complete* checkpoint in
``--ckpt`` if there is one (``engine.load`` under torchrun: every rank loads its own file,
checked against the manifest) and continues from ``pipe.steps``; every ``--save-every``
steps it flushes and saves (``engine.save``: one file per rank, then the manifest). When a
rank dies, torchrun's agent stops the others and, with ``--max-restarts N``, starts the job
again; the restarted job resumes from the last checkpoint, and -- because the data of step t
depends only on t and the checkpoint holds weights, optimizer state, counters and RNG --
ends with exactly the weights of an uninterrupted run (on CPU, bit for bit).

``--die-at T --die-rank R`` makes rank R exit abruptly (``os._exit``, no cleanup) before step
T on the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``), to try it out.
``--out DIR`` writes each rank's final stage weights to ``DIR/rank<r>.safetensors``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
from torch import nn

import engine
import engine.optim

DIM, OUT, CHUNKS = 6, 3, 4


def make_stage(s: int, S: int) -> nn.Module:
    torch.manual_seed(1000 + s)
    if s == S - 1:
        return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, OUT))
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())


def batch(step: int, B: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of step ``step`` (a function of the step alone, so a resumed job reads on)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(B, DIM, generator=g), torch.randn(B, OUT, generator=g)


def build(S: int, schedule: str, transport: str) -> engine.Pipeline:
    stages: list[Callable[[], nn.Module]] = [lambda s=s: make_stage(s, S) for s in range(S)]
    return engine.Pipeline(
        stages if transport != "local" else [f() for f in stages],
        schedule=schedule,
        chunks=CHUNKS,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: engine.optim.Adam(p, lr=1e-2),
        transport=transport,
        timeout=30,
    )


def train(pipe: engine.Pipeline, steps: int, save_every: int, ckpt: str | None, before_step: Callable[[int], None] | None = None) -> None:
    """Steps pipe.steps .. steps-1, flushing (and saving to ``ckpt``) every ``save_every``."""
    for t in range(pipe.steps, steps):
        if before_step is not None:
            before_step(t)
        pipe.step(*batch(t))
        if (t + 1) % save_every == 0:
            pipe.flush()
            if ckpt is not None:
                engine.save(pipe, ckpt)
    pipe.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (shared by all ranks)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    pipe = build(world, args.schedule, "gloo")
    rank, attempt = pipe.layout.rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.path.exists(os.path.join(args.ckpt, "manifest.json")):
        engine.load(pipe, args.ckpt)
    print(f"rank {rank} attempt {attempt}: starting at step {pipe.steps}", flush=True)

    def crash(t: int) -> None:
        if t == args.die_at and rank == args.die_rank and attempt == 0:
            os._exit(17)  # a crash: no cleanup, no goodbye

    train(pipe, args.steps, args.save_every, args.ckpt, crash)
    if args.out is not None:
        from safetensors.torch import save_file

        os.makedirs(args.out, exist_ok=True)
        weights = {k: v.contiguous() for k, v in pipe.stages[0].module.state_dict().items()}
        save_file(weights, os.path.join(args.out, f"rank{rank}.safetensors"))
    print(f"rank {rank} attempt {attempt}: done at step {pipe.steps}", flush=True)


if __name__ == "__main__":
    main()
