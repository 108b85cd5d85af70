"""What activation recomputation (``checkpoint=``) costs in time and saves in memory.

Why: the default of ``engine.Pipeline(checkpoint=...)`` and of the CLI's ``--recompute`` is
decided by this measurement. Each case builds the same model twice, as a 1F1B pipeline of
S = 4 stages with M = 8 micro-batches, once with ``checkpoint="except_last"`` (every stage
but the last re-runs its forward in the backward) and once with ``"never"``, and times one
``step()`` of each in alternating paired rounds (bench/harness.py), same data, same
optimizer (torch.optim.SGD, momentum 0.9). A second row prices ``"never"`` against plain
torch: the unsplit model over the same 8 micro-batches with accumulated gradients and one
step, so ``never / torch`` is the engine's own overhead.

Memory is measured, not modelled: ``activation_bytes`` (engine/cli/loop.py) is what one
micro-batch leaves saved at each stage (its input plus every tensor autograd saves), and
``pipe.stats()["activation_peak"]`` how many micro-batches each stage held at once. Without
recomputation a stage holds peak x saved bytes; with it, peak x input bytes plus one
micro-batch's saved bytes while it is recomputed (the last stage never recomputes).

Cases: ``gpt`` (engine.demo.models.gpt: 10 layers, width 64, context 32, batch 8 per
micro-batch) and ``cnn`` (4 stages of two 3x3 convolutions, 16 channels, 32x32 images,
batch 8 per micro-batch).

    python bench/recompute.py --out /tmp/recompute            # both cases, 11 rounds
    python bench/recompute.py --quick --out /tmp/r             # smoke run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import paired, summary_line, write_ratio_csv  # noqa: E402
from outputs import DEFAULT_OUT  # noqa: E402

import engine  # noqa: E402
import engine.demo.models  # noqa: E402
from engine.cli.loop import activation_bytes  # noqa: E402
from engine.runtime.stage.trees import call, tensors  # noqa: E402

S, M, BATCH = 4, 8, 8


def gpt_case() -> tuple[Callable[[], list[nn.Module]], Tensor, Tensor, Callable[..., Tensor]]:
    def make() -> list[nn.Module]:
        torch.manual_seed(0)
        model = engine.demo.models.gpt(64, 32, layers=10, width=64, heads=2, tie=False)
        return engine.demo.models.split_layers(model, [3, 2, 2, 3])

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (M * BATCH, 33), generator=g)
    return make, tokens[:, :-1], tokens[:, 1:], F.cross_entropy


def cnn_case() -> tuple[Callable[[], list[nn.Module]], Tensor, Tensor, Callable[..., Tensor]]:
    def block(cin: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, 16, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())

    def make() -> list[nn.Module]:
        torch.manual_seed(0)
        head = nn.Sequential(block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        return [block(3), block(16), block(16), head]

    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (M * BATCH,), generator=g)
    return make, x, y, F.cross_entropy


CASES = {"gpt": gpt_case, "cnn": cnn_case}


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def pipeline(stages: list[nn.Module], checkpoint: str, loss_fn: Callable[..., Tensor]) -> engine.Pipeline:
    return engine.Pipeline(stages, schedule="1f1b", chunks=M, loss_fn=loss_fn,
                           optimizer=sgd, checkpoint=checkpoint)


def torch_step(stages: list[nn.Module], loss_fn: Callable[..., Tensor]) -> Callable[[Tensor, Tensor], None]:
    """The unsplit model: M micro-batches, gradients accumulated (loss / M), one step."""
    params = [p for m in stages for p in m.parameters()]
    opt = sgd(params)

    def step(x: Tensor, y: Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            h = xm
            for m in stages:
                h = call(m, h)
            (loss_fn(h, ym) / M).backward()
        opt.step()

    return step


def memory(make: Callable[[], list[nn.Module]], x: Tensor, y: Tensor,
           loss_fn: Callable[..., Tensor]) -> dict[str, float]:
    """Peak activation bytes summed over stages, without and with recomputation."""
    stages = make()
    saved = activation_bytes(stages, x[:BATCH])
    inputs, h = [], x[:BATCH]
    for m in stages:
        inputs.append(sum(t.numel() * t.element_size() for t in tensors(h)))
        with torch.no_grad():
            h = call(m, h)
    pipe = pipeline(make(), "never", loss_fn)
    pipe.step(x, y)
    peak = pipe.stats()["activation_peak"]
    never = sum(p * a for p, a in zip(peak, saved, strict=True))
    recompute = (sum(p * i for p, i in zip(peak[:-1], inputs[:-1], strict=True))
                 + max(saved[:-1]) + peak[-1] * saved[-1])
    return {"act_never_kib": never / 1024, "act_recompute_kib": recompute / 1024}


def run(name: str, rounds: int, warmup: int, min_time: float, label: str) -> list:
    make, x, y, loss_fn = CASES[name]()
    mem = memory(make, x, y, loss_fn)
    recompute = pipeline(make(), "except_last", loss_fn)
    never = pipeline(make(), "never", loss_fn)
    plain = torch_step(make(), loss_fn)
    rows = []
    res = paired(lambda: recompute.step(x, y), lambda: never.step(x, y),
                 rounds=rounds, warmup=warmup, min_time=min_time)
    rows.append(res.row("recompute", f"{name} 1f1b S={S} M={M}", "checkpoint=except_last",
                        "checkpoint=never", label=label, extra=mem))
    res = paired(lambda: never.step(x, y), lambda: plain(x, y),
                 rounds=rounds, warmup=warmup, min_time=min_time)
    rows.append(res.row("recompute", f"{name} 1f1b S={S} M={M}", "checkpoint=never",
                        "torch, unsplit, same micro-batches", label=label, extra=mem))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for recompute.csv")
    ap.add_argument("--cases", default="gpt,cnn", help="comma list of cases: gpt, cnn")
    ap.add_argument("--rounds", type=int, default=11, help="paired rounds per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls of each side first")
    ap.add_argument("--min-time", type=float, default=0.2,
                    help="seconds the faster side's timed block lasts (sets calls per block)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, short blocks: a smoke run")
    ap.add_argument("--label", default="", help="machine label for the CSV, e.g. 'CPU, 2 cores'")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    for name in names:
        if name not in CASES:
            ap.error(f"--cases: unknown case {name!r}; choose from {', '.join(CASES)}")
    if args.quick:
        args.rounds, args.warmup, args.min_time = 3, 1, 0.01
    torch.set_num_threads(1)
    rows = []
    for name in names:
        for row in run(name, args.rounds, args.warmup, args.min_time, args.label):
            print(summary_line(row), f"activations: {row.extra['act_never_kib']:.0f} KiB never, "
                  f"{row.extra['act_recompute_kib']:.0f} KiB recomputing", flush=True)
            rows.append(row)
    write_ratio_csv(rows, args.out / "recompute.csv")
    print(f"wrote {args.out / 'recompute.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
