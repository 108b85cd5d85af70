"""Basis rotation's cost on the bundled language model: time per optimizer step and state bytes,
against AdamW, over the parameters of ``engine.demo.models.gpt`` as ``--task lm`` builds it.

Why: basis rotation is matrix work (covariance products every step, eigh/QR on refreshes,
four projections per matrix), so its price is not a bandwidth ratio like the elementwise
optimizers' (bench/optim.py): the issue asks whether it fits the LM job's budget at all.

The gradients are real: one forward/backward of the model on a batch of the corpus. Both
sides step the same parameters (copies) with the same gradients; rounds alternate
AdamW / basis rotation and each round times ``--steps`` steps (basis rotation's refreshes
included: every T-th step runs the QR power iteration), median over rounds. AdamW is
``engine.optim.AdamW`` as the CLI builds it for one model-sized group (on CPU its per-tensor
reference path); ``--flat`` first puts the parameters in one arena bucket (one flat update,
as inside the pipeline).

    python bench/optim_basis_rotation.py --layers 16 --width 32 --rounds 7 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import engine
from engine.demo.data import load_lm_dataset
from engine.demo.models import gpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--frequency", type=int, default=10, help="T, the refresh period")
    ap.add_argument("--geometry", choices=("bi", "uni"), default="bi", help="rotation_geometry")
    ap.add_argument("--flat", action="store_true", help="AdamW over one arena bucket")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the CLI's default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    data = load_lm_dataset()
    model = gpt(data.num_classes, data.num_features, args.layers, args.width, tie=False)
    x, y = data.train_x[: args.batch], data.train_y[: args.batch]
    out = model(x)
    torch.nn.functional.cross_entropy(out, y).backward()  # logits are (batch, vocab, time)
    grads = [p.grad.detach().clone() for p in model.parameters()]

    def copies() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        if args.flat:
            holder = torch.nn.ParameterList(ps)
            engine.flatten_(holder)
            ps = list(holder)
        return ps

    sides = {
        "adamw": lambda ps: engine.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.999), weight_decay=0.1),
        "basis-rotation": lambda ps: engine.optim.BasisRotation(
            ps, lr=3e-3, betas=(0.9, 0.999), weight_decay=0.1,
            precondition_frequency=args.frequency, rotation_geometry=args.geometry),
    }
    opts = {}
    for name, make in sides.items():
        ps = copies()
        opts[name] = (make(ps), ps)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds + 1):  # round 0 warms up (state created, first eigh)
        for name, (opt, ps) in opts.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                for p, g in zip(ps, grads, strict=True):
                    if p.grad is None:
                        p.grad = g.clone()
                opt.step()
            if r:
                times[name].append((time.perf_counter() - t0) / args.steps)
    n_params = sum(p.numel() for p in model.parameters())
    matrices = sum(1 for p in model.parameters() if p.dim() == 2)
    print(f"model: gpt layers={args.layers} width={args.width} vocab={data.num_classes} "
          f"context={data.num_features}: {n_params:,} params, {matrices} matrices; "
          f"AdamW {'flat (one arena bucket)' if args.flat else 'per tensor'}; "
          f"T={args.frequency}, {args.geometry}; {args.rounds} rounds x {args.steps} steps; {args.threads} thread(s); "
          f"torch {torch.__version__}")
    state_adamw = sum(t.numel() * t.element_size() for s in opts["adamw"][0].state.values()
                      for k, t in s.items() if k != "step")
    mem = opts["basis-rotation"][0].memory_bytes()
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:15s} step median {med[name] * 1e3:8.3f} ms  (min {min(v) * 1e3:.3f}, "
              f"max {max(v) * 1e3:.3f})")
    print(f"ratio basis-rotation / adamw: {med['basis-rotation'] / med['adamw']:.2f}x per step")
    print(f"state bytes: adamw {state_adamw:,}; basis-rotation moments {mem['moments']:,} + "
          f"rotation {mem['rotation']:,} (extra {mem['rotation'] / max(state_adamw, 1):.2f}x "
          f"AdamW's state, {mem['rotation'] / (4 * n_params):.2f}x the fp32 weights)")


if __name__ == "__main__":
    main()
