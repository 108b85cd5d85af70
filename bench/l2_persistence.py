"""Benchmark: does pinning a stage's flat weight buffer in L2 speed up its forward/backward?

Why this exists: a pipeline stage re-reads the same weights for every micro-batch, while
activations, gradients and communication buffers stream past and evict them from L2. The
arena keeps the whole live buffer contiguous, so one CUDA access-policy window
(``WeightArena.set_l2_persistence``) can mark it persisting. This script measures a small MLP
stage (weights sized to fit in the persisting set-aside) with small micro-batches, a
streaming "pollution" pass between iterations standing in for the other traffic, with the
window on and off, and reports the ratio together with what the device granted.

How (bench/harness.py, like every ratio here): alternating paired rounds, persisting (the
candidate) and normal (the peer), AB, BA, ...; before each block the harness's ``setup``
switches the window on (``set_l2_persistence``: set-aside + window on the stream) or off
(``clear_l2_persistence``: window removed, persisting lines reset, set-aside 0), outside the
timed window. One iteration = the pollution pass, then forward+backward. By default the
forward+backward is captured in a CUDA graph, which takes the launch overhead out of a
few-kernel step: two graphs, one captured while the window is set on the capture stream
(for the persisting side) and one without (for the normal side). Whether a captured kernel
keeps the stream's access-policy window is the CUDA runtime's business; ``--no-graph`` runs
the same measurement eagerly, so a first GPU run should compare the two. Two ratios, each a
median with a 95 % interval over the same rounds:

* ``fwd+bwd (CUDA events)``: device time of the forward+backward alone (events around it);
* ``iteration (wall clock)``: the whole iteration, pollution included, per call.

Writes ``l2_persistence_ratios.csv`` (the ratio schema of every benchmark here; ``extra``
holds granted/window/max persisting bytes and the hit ratio) and ``l2_persistence.csv`` (one
summary row: device, granted bytes, baseline/persisting ms, speedup = 1 / the device-time
ratio, note), and prints both.

Usage:  python3 bench/l2_persistence.py --out OUTDIR [--quick] [--no-graph]
On a machine without a GPU it prints why and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import DEFAULT_OUT  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=6, help="Linear layers in the stage")
    p.add_argument("--batch", type=int, default=16, help="micro-batch size")
    p.add_argument("--iters", type=int, default=200,
                   help="timed iterations per side in all (rounds x iterations per block)")
    p.add_argument("--rounds", type=int, default=20, help="paired rounds (on/off blocks)")
    p.add_argument("--warmup", type=int, default=20, help="untimed iterations per side")
    p.add_argument("--pollute-mb", type=int, default=256, help="streamed bytes between iterations")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="run forward+backward eagerly instead of replaying CUDA graphs")
    p.add_argument("--label", default="", help="machine label for the ratio CSV")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 3 rounds of 4 iterations")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.rounds, args.iters, args.warmup = 2, 3, 12, 2
    if args.rounds < 1 or args.iters < 1:
        p.error(f"need --rounds >= 1 and --iters >= 1 (got {args.rounds}, {args.iters})")
    args.rounds = min(args.rounds, args.iters)  # at least one iteration per block
    return args


class EventTimes:
    """A harness probe: device time of the part of each call bracketed by ``record``."""

    name = "fwdbwd_s"

    def __init__(self) -> None:
        self.pending: list[tuple[Any, Any]] = []

    def start(self) -> None:
        self.pending.clear()

    def stop(self, _token: None) -> float:  # the harness has synchronised the device
        total_ms = sum(s.elapsed_time(e) for s, e in self.pending)
        self.pending.clear()
        return total_ms / 1e3


def capture(step, stream, warmup: int):
    """A CUDA graph of ``step()`` captured on ``stream`` (eager warm-up first, as
    torch.cuda.graphs asks, so autograd and the allocator are initialised)."""
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(3, warmup)):
            step()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    stream.synchronize()
    return graph


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch import nn

    if not torch.cuda.is_available():
        print("l2_persistence: no GPU available (torch.cuda.is_available() is False); skipped")
        return 0
    from harness import paired, summary_line, write_ratio_csv

    from engine.arena import flatten_

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    stage = nn.Sequential(*layers).to(device=device, dtype=dtype)
    arena = flatten_(stage, name="l2-bench")
    x = torch.randn(args.batch, args.hidden, device=device, dtype=dtype)
    pollute = torch.zeros(args.pollute_mb * 2**20 // 4, device=device, dtype=torch.float32)
    stream = torch.cuda.Stream()
    weight_bytes = arena.bytes()["live"]

    def fwd_bwd() -> None:
        stage(x).float().square().mean().backward()  # grads accumulate in the arena's buffer

    # what the device grants (asked once before anything is timed; the same request is made
    # before every persisting block)
    granted = arena.set_l2_persistence(stream=stream)
    mode, note = ("graph" if args.graph else "eager"), ""
    graphs: dict[str, Any] = {}
    if granted.ok and args.graph:
        try:
            graphs["candidate"] = capture(fwd_bwd, stream, args.warmup)  # window set on the stream
            arena.clear_l2_persistence(bucket=granted.bucket, stream=stream)
            graphs["peer"] = capture(fwd_bwd, stream, args.warmup)  # no window
        except RuntimeError as exc:  # a capture that fails is reported, and measured eagerly
            mode, note = "eager", f"CUDA graph capture failed ({str(exc).splitlines()[0]}); eager"
            graphs.clear()
    if granted.ok:
        arena.clear_l2_persistence(bucket=granted.bucket, stream=stream)

    name = torch.cuda.get_device_name(device)
    row: dict[str, Any] = {
        "device": name, "dtype": args.dtype, "hidden": args.hidden, "layers": args.layers,
        "batch": args.batch, "mode": mode, "weight_bytes": weight_bytes,
        "pollute_bytes": pollute.numel() * 4, "granted_bytes": granted.granted_bytes,
        "window_bytes": granted.window_bytes, "max_persisting_bytes": granted.max_persisting_bytes,
        "hit_ratio": f"{granted.hit_ratio:.3f}",
    }
    ratio_rows = []
    if granted.ok:
        probe = EventTimes()

        def side_call(side: str):
            graph = graphs.get(side)
            run = graph.replay if graph is not None else fwd_bwd

            def call() -> None:
                with torch.cuda.stream(stream):
                    pollute.add_(1)  # other traffic evicts non-persisting lines
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    run()
                    end.record(stream)
                probe.pending.append((start, end))

            return call

        requests = []

        def setup(side: str) -> None:
            if side == "candidate":
                requests.append(arena.set_l2_persistence(stream=stream))
            else:
                arena.clear_l2_persistence(bucket=granted.bucket, stream=stream)

        try:
            res = paired(side_call("candidate"), side_call("peer"), rounds=args.rounds,
                         warmup=args.warmup, inner=args.iters // args.rounds, device=device,
                         probes=[probe], setup=setup)
        finally:
            arena.clear_l2_persistence(bucket=granted.bucket, stream=stream)
        if any(r.granted_bytes != granted.granted_bytes or not r.ok for r in requests):
            note += "; the grant changed between rounds: " + ", ".join(
                sorted({f"{r.granted_bytes} B ok={r.ok}" for r in requests}))
        extra = {
            "granted_bytes": granted.granted_bytes, "window_bytes": granted.window_bytes,
            "max_persisting_bytes": granted.max_persisting_bytes, "hit_ratio": granted.hit_ratio,
            "weight_bytes": weight_bytes, "pollute_bytes": pollute.numel() * 4,
            "cuda_graph": float(mode == "graph"),
        }
        case = f"{args.layers}x{args.hidden} {args.dtype} batch {args.batch} ({mode})"
        dev_res = res.by_probe(EventTimes.name)
        ratio_rows = [
            dev_res.row("l2_persistence", f"{case} fwd+bwd (CUDA events)", "persisting", "normal",
                        label=args.label, note=note.strip("; "), extra=extra),
            res.row("l2_persistence", f"{case} iteration incl. pollution (wall clock)",
                    "persisting", "normal", label=args.label, note=note.strip("; "), extra=extra),
        ]
        base_ms, l2_ms = ratio_rows[0].peer_ms, ratio_rows[0].candidate_ms
        row.update({
            "baseline_ms": f"{base_ms:.4f}", "persisting_ms": f"{l2_ms:.4f}",
            "speedup": f"{1 / ratio_rows[0].median_ratio:.3f}",
            "ratio_ci": f"[{ratio_rows[0].ci_low:.3f}, {ratio_rows[0].ci_high:.3f}]",
            "rounds": args.rounds, "note": note.strip("; ") or "ok",
        })
    else:
        row.update({"baseline_ms": "nan", "persisting_ms": "nan", "speedup": "nan",
                    "ratio_ci": "", "rounds": 0, "note": granted.reason or "not granted"})
        print(f"l2_persistence on {name}: no window ({granted.reason}); nothing timed")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "l2_persistence.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    print(
        f"l2_persistence on {name}: weights {weight_bytes / 2**20:.1f} MiB, granted "
        f"{granted.granted_bytes / 2**20:.1f} MiB (window {granted.window_bytes / 2**20:.1f} MiB, "
        f"hit ratio {granted.hit_ratio:.2f}, max persisting {granted.max_persisting_bytes / 2**20:.1f} MiB)"
    )
    for r in ratio_rows:
        print(summary_line(r))
    if ratio_rows:
        write_ratio_csv(ratio_rows, args.out / "l2_persistence_ratios.csv")
        print(f"wrote {path} and {args.out / 'l2_persistence_ratios.csv'}")
    else:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
