"""Shared pieces of every benchmark under bench/: one CSV schema, one timer, one plot style.

Every benchmark writes rows with the same columns so results from different kernels,
devices and versions can be concatenated and compared. Speed claims are ratios against a
peer measured in the same run on the same device, never absolute numbers from elsewhere.
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

import engine


@dataclass
class Row:
    """One measurement: a kernel run by a provider on a buffer of ``size_bytes``."""

    kernel: str
    provider: str
    dtype: str
    size_bytes: int
    numel: int
    median_ms: float
    p20_ms: float
    p80_ms: float
    gbps: float
    pct_of_copy: float
    device: str
    torch: str
    triton: str
    engine: str


COLUMNS = [f.name for f in fields(Row)]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def under_torchrun(ranks: int, script: str) -> None:
    """Started as a plain script (no ``RANK`` in the environment, e.g. by .ci/gpu): run
    ``script`` again under torchrun with ``ranks`` processes, with this process's arguments,
    and exit with its status. Under torchrun: return."""
    if "RANK" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(ranks), script, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd))


def versions() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    return {"torch": torch.__version__, "triton": triton_version, "engine": engine.__version__}


def measure(fn: Callable[[], object], device: torch.device, *, rep_ms: int = 100) -> tuple[float, float, float]:
    """Median, 20th and 80th percentile time of ``fn`` in milliseconds.

    On a GPU this is ``triton.testing.do_bench`` (L2 flushed before every run). On CPU, where
    do_bench has no device events, a wall-clock loop with the same quantiles stands in so the
    harness itself can be exercised; CPU numbers are not the point of these benchmarks.
    """
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return float(med), float(p20), float(p80)
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()

    def quantile(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))]

    return quantile(0.5), quantile(0.2), quantile(0.8)


def write_csv(rows: Iterable[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def parse_size(text: str) -> int:
    """'1MiB' -> 1048576; plain integers are bytes."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"
