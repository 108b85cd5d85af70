"""The cost of delay-compensated gradients on the CPU reference path: a step with PipeMare T2
and ``delay_compensation`` on against the same step with it off (``engine.optim.SGD`` /
``Adam``, one flat tensor, plain torch ops).

Why: with T2 on, DC adds no buffer (it reads T2's delta); on the reference path it adds the
elementwise g + lambda * tau * g * g * delta (three torch ops, the product in the reused
workspace), which is the whole CPU cost. Paired alternating rounds through bench/harness.py,
median time ratio with a 95 % interval.

    python bench/dc_cost.py --out /tmp/dc            # 4M params, 15 rounds
    python bench/dc_cost.py --quick --out /tmp/dc    # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    paired,
    size_and_rounds,
    size_arguments,
    summary_line,
    write_ratio_csv,
)

import engine.optim as eo  # noqa: E402

FAMILIES = {"sgd": (eo.SGD, dict(lr=1e-4, momentum=0.9)), "adam": (eo.Adam, dict(lr=1e-4))}


def steps(family: str, n: int) -> tuple[object, object]:
    cls, kw = FAMILIES[family]
    g = torch.Generator().manual_seed(0)
    w, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    sides = []
    for lam in (1.0, 0.0):
        p = torch.nn.Parameter(w.clone())
        p.grad = grad
        opt = cls([p], delay=3, discrepancy_correction=True, delay_compensation=lam, **kw)
        sides.append(opt.step)
    return sides[0], sides[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_arguments(ap, params=4 * 2**20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, rounds = size_and_rounds(args)
    rows = []
    for family in FAMILIES:
        candidate, peer = steps(family, n)
        res = paired(candidate, peer, rounds=rounds, warmup=2)
        rows.append(res.row("dc_cost", f"{family} {n} fp32 params, 1 thread",
                            "T2 + delay compensation (reference)", "T2 (reference)",
                            label=args.label))
        print(summary_line(rows[-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_ratio_csv(rows, out / "dc_cost.csv")


if __name__ == "__main__":
    main()
