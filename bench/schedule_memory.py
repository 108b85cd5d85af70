"""Activation memory per rank, measured: 1f1b, zbv, vhalf and vmin on the same model.

Why: V-Min and V-Half (engine/schedule/vblocks.py) promise a rank peak of (p+4)//3 and
(p+2)//2 micro-batches of its layers where 1F1B holds p, and ``schedule="auto"`` chooses by
the analysis's predicted peak; both claims are only as good as the runtime's actual memory.
This benchmark runs the schedules on one model and measures, for every rank, the most bytes
its stages hold in tensors autograd saved for the backward -- from the running pipeline, not
from the schedule -- and compares with 1F1B's and with the prediction of
:func:`engine.schedule.analysis.rank_activation_bytes`.

The model: ``--layers`` identical blocks (Linear(W, W) then GELU; each saves two B x W float32
tensors per micro-batch) split into p stages for 1f1b (one per rank) and 2p for the V families
(rank r holds stages r and 2p-1-r, each half of 1F1B's layers), M = ``--chunks`` micro-batches
of ``--batch`` samples, SGD. Every rank's layers are the same in every family, so the ratios
are the memory the schedule saves.

How it is measured: the pipelines run with ``transport="local"``: one process runs every rank,
each rank its own actions in its own order (the program's rank order, the same a process per
rank runs under gloo), so a rank's memory over time is what its process would hold. Each
stage module runs inside ``torch.autograd.graph.saved_tensors_hooks`` that count, per rank,
the bytes of every distinct tensor autograd saves (parameters excluded) from the forward
that saves it until autograd drops it (after the stage's W, or its whole backward); the rank's
peak is the largest total it ever reaches. The prediction multiplies the same hooks'
bytes for one micro-batch of each stage alone by the analysis's walk of each rank's order.

Step time: each family's pipeline (without the counting hooks) against 1f1b's in alternating
paired rounds (bench/harness.py). With every rank in one process this is the engine's cost of
running the family's actions, not the bubble a process per rank would see.

    python bench/schedule_memory.py --out bench/results          # p=8, M=16, 11 rounds
    python bench/schedule_memory.py --quick --out /tmp/sm        # smoke run (p=4, M=8)
"""

from __future__ import annotations

import argparse
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import paired, summary_line, write_ratio_csv  # noqa: E402

import engine  # noqa: E402
from engine.schedule import family, generate  # noqa: E402
from engine.schedule.analysis import rank_activation_bytes  # noqa: E402

FAMILIES = ("1f1b", "zbv", "vhalf", "vmin")
#: the paper's rank peak against 1F1B's p, for the families that claim one
CLAIMS: dict[str, Callable[[int], float]] = {
    "vhalf": lambda p: ((p + 2) // 2) / p,
    "vmin": lambda p: ((p + 4) // 3) / p,
}
TOLERANCE = 0.05


class SavedBytes:
    """The bytes one rank's stages hold in saved tensors now, and the most ever held."""

    def __init__(self) -> None:
        self.refs: dict[tuple[int, int], list[int]] = {}  # (address, bytes) -> [references, bytes]
        self.now = 0
        self.peak = 0

    def hold(self, t: Tensor) -> object:
        # a tensor's own bytes, once however often it is saved: a micro-batch that is a view
        # of the whole batch counts its own rows, not the batch it was cut from
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes)
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, nbytes]
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        box = _Saved(t)
        weakref.finalize(box, self._drop, key)
        return box

    def _drop(self, key: tuple[int, int]) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]
            self.now -= entry[1]


class _Saved:
    """What autograd keeps for one saved tensor: the tensor, and a lifetime to watch."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: Tensor) -> None:
        self.t = t


class Metered(nn.Module):
    """A stage whose forward counts the tensors autograd saves into its rank's meter."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.meter: SavedBytes | None = None

    def forward(self, x: Tensor) -> Tensor:
        meter = self.meter
        if meter is None:
            return self.inner(x)
        params = {p.untyped_storage().data_ptr() for p in self.inner.parameters()}

        def pack(t: Tensor) -> object:
            if t.untyped_storage().data_ptr() in params:
                return t  # weights are weight memory, not activations
            return meter.hold(t)

        def unpack(saved: object) -> Tensor:
            return saved.t if isinstance(saved, _Saved) else saved  # type: ignore[return-value]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.inner(x)


def model(layers: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]


def stages_of(blocks: list[nn.Module], stages: int) -> list[nn.Module]:
    per = len(blocks) // stages
    return [nn.Sequential(*blocks[s * per:(s + 1) * per]) for s in range(stages)]


def stage_count(name: str, p: int) -> int:
    return p * (family(name).placement.per_rank or 1)


def build(name: str, p: int, args: argparse.Namespace, metered: bool) -> engine.Pipeline:
    S = stage_count(name, p)
    mods = stages_of(model(args.layers, args.width), S)
    if metered:
        mods = [Metered(m) for m in mods]
    return engine.Pipeline(mods, schedule=name, chunks=args.chunks, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))


def program_of(pipe: engine.Pipeline) -> Any:
    spec = pipe.spec
    if spec.program is not None:
        return spec.program
    return generate(spec.name, spec.stages, spec.chunks)


def measure(name: str, p: int, args: argparse.Namespace, x: Tensor, y: Tensor) -> dict[str, Any]:
    """Measured and predicted peak saved bytes per rank of ``name``."""
    pipe = build(name, p, args, metered=True)
    program = program_of(pipe)
    meters = [SavedBytes() for _ in range(program.ranks)]
    # one micro-batch through each stage alone: the bytes it leaves saved
    per_stage = []
    h = x[: args.batch]
    for st in pipe.stages:
        alone = SavedBytes()
        st.module.meter = alone
        inp = h.detach().requires_grad_(True)
        out = st.module(inp)
        per_stage.append(alone.peak)
        h = out.detach()
        del out, inp
        st.module.meter = meters[program.rank_of(st.index)]
    for _ in range(args.steps):
        pipe.step(x, y)
    assert all(m.now == 0 for m in meters), "saved tensors outlived the step"
    return {
        "measured": [m.peak for m in meters],
        "predicted": list(rank_activation_bytes(program, per_stage)),
        "stage_bytes": per_stage,
        "ranks": program.ranks,
        "stages": program.stages,
    }


def run(args: argparse.Namespace) -> list[Any]:
    p, M, B = args.ranks, args.chunks, args.batch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * B, args.width, generator=g)
    y = torch.randn(M * B, args.width, generator=g)
    mem = {name: measure(name, p, args, x, y) for name in FAMILIES}
    base = max(mem["1f1b"]["measured"])
    peer = build("1f1b", p, args, metered=False)
    rows = []
    for name in FAMILIES:
        m = mem[name]
        ratios = [v / base for v in m["measured"]]
        err = max(abs(a - b) / a for a, b in zip(m["measured"], m["predicted"], strict=True))
        claim = CLAIMS.get(name)
        extra: dict[str, Any] = {
            "measured_peak_bytes": m["measured"],
            "predicted_peak_bytes": m["predicted"],
            "stage_bytes_per_microbatch": m["stage_bytes"],
            "peak_ratio_to_1f1b": max(ratios),
            "rank_ratios_to_1f1b": [round(r, 4) for r in ratios],
            "prediction_error": err,
            "prediction_within_5pct": err <= TOLERANCE,
            "ranks": m["ranks"],
            "stages": m["stages"],
        }
        if claim is not None:
            extra["claim_ratio"] = claim(p)
            extra["meets_claim"] = max(ratios) <= claim(p) * (1 + TOLERANCE)
        cand = build(name, p, args, metered=False)
        res = paired(lambda c=cand: c.step(x, y), lambda: peer.step(x, y),
                     rounds=args.rounds, warmup=args.warmup, min_time=args.min_time)
        row = res.row("schedule_memory", f"p={p} M={M} layers={args.layers} width={args.width} "
                      f"batch={B}", f"engine {name}", "engine 1f1b", label=args.label, extra=extra,
                      note="local transport: every rank in one process; memory per rank from "
                      "saved-tensor hooks")
        rows.append(row)
        print(summary_line(row), f"| peak {max(m['measured'])} B = {max(ratios):.3f}x 1f1b's "
              f"(claim {extra.get('claim_ratio', '-')}), prediction off by {err:.2%}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/bench"),
                    help="folder for schedule_memory.csv (the tracked result: bench/results)")
    ap.add_argument("--ranks", type=int, default=8, help="p: ranks (1f1b's stages; V: 2p)")
    ap.add_argument("--chunks", type=int, default=16, help="M: micro-batches per step")
    ap.add_argument("--layers", type=int, default=32, help="blocks; a multiple of 2p")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="samples per micro-batch")
    ap.add_argument("--steps", type=int, default=2, help="metered steps per family")
    ap.add_argument("--rounds", type=int, default=11, help="paired rounds per row")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--quick", action="store_true", help="p=4, M=8, 3 short rounds: a smoke run")
    ap.add_argument("--label", default="", help="machine label for the CSV")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.chunks, args.layers, args.width, args.batch = 4, 8, 8, 16, 4
        args.steps, args.rounds, args.warmup, args.min_time = 1, 3, 1, 0.01
    if args.layers % (2 * args.ranks):
        ap.error(f"--layers {args.layers} must be a multiple of 2 * --ranks = {2 * args.ranks}")
    torch.set_num_threads(1)
    rows = run(args)
    path = args.out / "schedule_memory.csv"
    write_ratio_csv(rows, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
