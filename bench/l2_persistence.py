"""Benchmark: does pinning a stage's flat weight buffer in L2 speed up its forward/backward?

Why this exists: a pipeline stage re-reads the same weights for every micro-batch, while
activations, gradients and communication buffers stream past and evict them from L2. The
arena keeps the whole live buffer contiguous, so one CUDA access-policy window
(``WeightArena.set_l2_persistence``) can mark it persisting. This script measures a small MLP
stage (weights sized to fit in the persisting set-aside) with small micro-batches, with a
streaming "pollution" pass between iterations standing in for the other traffic, with and
without the window, and reports the ratio together with what the device granted.

Usage:  python3 bench/l2_persistence.py --out OUTDIR   (writes OUTDIR/l2_persistence.csv)
On a machine without a GPU it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=6, help="Linear layers in the stage")
    p.add_argument("--batch", type=int, default=16, help="micro-batch size")
    p.add_argument("--iters", type=int, default=200, help="timed iterations per mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pollute-mb", type=int, default=256, help="streamed bytes between iterations")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    return p.parse_args(argv)


def run_mode(stage, x, pollute, stream, iters: int, warmup: int):
    import torch

    times = []
    with torch.cuda.stream(stream):
        for i in range(warmup + iters):
            pollute.add_(1)  # other traffic evicts non-persisting lines
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            stage(x).float().square().mean().backward()
            end.record(stream)
            if i >= warmup:
                times.append((start, end))
    stream.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2]  # median: robust to clock ramps and stray interrupts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch import nn

    if not torch.cuda.is_available():
        print("l2_persistence: no GPU available (torch.cuda.is_available() is False); skipped")
        return 0
    from engine.arena import flatten_

    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.GELU()]
    stage = nn.Sequential(*layers).to(device=device, dtype=dtype)
    arena = flatten_(stage, name="l2-bench")
    x = torch.randn(args.batch, args.hidden, device=device, dtype=dtype)
    pollute = torch.zeros(args.pollute_mb * 2**20 // 4, device=device, dtype=torch.float32)
    stream = torch.cuda.Stream()
    weight_bytes = arena.bytes()["live"]

    base_ms = run_mode(stage, x, pollute, stream, args.iters, args.warmup)
    result = arena.set_l2_persistence(stream=stream)
    try:
        if result.ok:
            l2_ms = run_mode(stage, x, pollute, stream, args.iters, args.warmup)
        else:
            l2_ms = float("nan")
    finally:
        if result.ok:
            arena.clear_l2_persistence(bucket=result.bucket, stream=stream)
    ratio = base_ms / l2_ms if result.ok else float("nan")
    name = torch.cuda.get_device_name(device)
    row = {
        "device": name,
        "dtype": args.dtype,
        "hidden": args.hidden,
        "layers": args.layers,
        "batch": args.batch,
        "weight_bytes": weight_bytes,
        "pollute_bytes": pollute.numel() * 4,
        "granted_bytes": result.granted_bytes,
        "window_bytes": result.window_bytes,
        "max_persisting_bytes": result.max_persisting_bytes,
        "hit_ratio": f"{result.hit_ratio:.3f}",
        "baseline_ms": f"{base_ms:.4f}",
        "persisting_ms": f"{l2_ms:.4f}",
        "speedup": f"{ratio:.3f}",
        "note": result.reason or "ok",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "l2_persistence.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    print(
        f"l2_persistence on {name}: weights {weight_bytes / 2**20:.1f} MiB, granted "
        f"{result.granted_bytes / 2**20:.1f} MiB (window {result.window_bytes / 2**20:.1f} MiB, "
        f"hit ratio {result.hit_ratio:.2f}); fwd+bwd {base_ms:.3f} ms -> {l2_ms:.3f} ms, "
        f"speedup x{ratio:.3f}" + ("" if result.ok else f" [{result.reason}]")
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
