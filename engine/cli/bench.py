"""``python -m engine bench``: the optimizer-kernel microbenchmark (bench/optim.py).

Why a wrapper: the benchmark lives in the repository's ``bench/`` folder (it is not part of
the installed package) and measures GPU memory bandwidth, so on a CPU machine its numbers
would mean nothing. This command finds ``bench/optim.py`` next to the package, runs the full
sweep on a GPU, and on CPU says so and runs the tiny ``--smoke`` sweep only when asked (it
exercises the harness through the Triton interpreter; the timings are not benchmarks). It
writes to ``out/bench`` unless ``--out`` names another folder, and never over an earlier
run's files there unless ``--overwrite`` (engine/cli/outdir.py).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from engine.cli import CLIError
from engine.cli.outdir import claim

__all__ = ["add_arguments", "run", "bench_script"]

#: what bench/optim.py writes in --out
OUTPUTS = ("optim.csv", "optim_ratios.csv", "optim.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes: check the harness (works on CPU)"
    )
    p.add_argument(
        "--out", default="out/bench",
        help="folder for optim.csv, optim_ratios.csv and optim.png (default out/bench; the "
        "repository's tracked bench/results only when named here); an earlier run's files "
        "there stop the command unless --overwrite",
    )
    p.add_argument("--overwrite", action="store_true",
                   help="delete an earlier run's optim.csv, optim_ratios.csv, optim.png in --out first")
    p.add_argument("--kernels", default=None, help="comma list of kernels (default: all)")
    p.add_argument("--dtypes", default=None, help="comma list of dtypes (default fp32,bf16)")
    p.add_argument("--sizes", default=None, help="comma list of buffer sizes, e.g. 1MiB,64MiB")


def bench_script() -> Path:
    path = Path(__file__).resolve().parents[2] / "bench" / "optim.py"
    if not path.exists():
        raise CLIError(
            f"{path} not found: the benchmark ships with the source repository, not the wheel; "
            "run from a checkout of pipeline-engine"
        )
    return path


def run(args: argparse.Namespace) -> int:
    import torch

    script = bench_script()
    argv = ["--out", args.out]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print(
            "python -m engine bench: the kernel benchmark measures GPU memory bandwidth and needs a "
            "CUDA GPU; none is visible. Run `python -m engine bench --smoke` to exercise the harness on CPU."
        )
        return 0
    claim(Path(args.out), OUTPUTS, overwrite=args.overwrite)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(
            "no CUDA GPU: running the --smoke sweep on CPU through the Triton interpreter "
            "(checks the harness; the timings are not benchmarks)"
        )
    argv += ["--device", device]
    if args.smoke:
        argv.append("--smoke")
    for flag, v in (
        ("--kernels", args.kernels),
        ("--dtypes", args.dtypes),
        ("--sizes", args.sizes),
    ):
        if v:
            argv += [flag, v]
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        mod = runpy.run_path(str(script), run_name="engine_bench")
        return int(mod["main"](argv) or 0)
    finally:
        sys.argv = saved
