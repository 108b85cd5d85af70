"""Optimizer-step microbenchmark: fused Triton kernels vs torch.optim vs the plain-torch composition.

An optimizer step is memory-bound: it reads weights, gradients and state once and writes
weights and state back. The honest yardstick is therefore the device's copy bandwidth,
measured in the same run, and the peers are torch.optim's own fast paths (foreach=True,
fused=True) and the plain foreach composition that computes the same outputs as our fused
SGD + spike compensation + weight prediction.

Two outputs: ``optim.csv`` (common.Row: bandwidth per provider, for the plot) and
``optim_ratios.csv`` (bench/harness.py's ratio schema: engine/peer time ratios from
alternating paired rounds, median and 95 % interval). Speed-up claims come from the latter.

GB/s is effective bandwidth: the minimal bytes each provider's formulation must move
(reads + writes of weights, gradients, state and outputs in that provider's dtypes) divided
by its time. "Faster than" claims compare times.

    python bench/optim.py --out bench/results            # GPU: the full sweep (1 MiB .. 1 GiB)
    python bench/optim.py --device cpu --smoke --out /tmp # CPU: exercise the harness (interpreted)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Row, device_name, format_size, measure, parse_size, versions, write_csv  # noqa: E402
from harness import RatioRow, paired, summary_line, write_ratio_csv  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNELS = ("sgd", "sgd_sc_pred", "adam")
DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
SMOKE_SIZES = "64KiB"

LR, MOMENTUM, DELAY = 1e-3, 0.9, 4
BETAS, EPS = (0.9, 0.999), 1e-8


def traffic_bytes(kernel: str, numel: int, param_bytes: int, state_bytes: int) -> int:
    """Minimal bytes moved: weights read+written, gradients read, state read+written, outputs."""
    if kernel == "copy":
        return 2 * numel * param_bytes
    if kernel == "sgd":
        return numel * (3 * param_bytes + 2 * state_bytes)
    if kernel == "sgd_sc_pred":  # + the predicted weights written
        return numel * (4 * param_bytes + 2 * state_bytes)
    if kernel == "adam":
        return numel * (3 * param_bytes + 4 * state_bytes)
    raise ValueError(f"unknown kernel {kernel!r}")


def _engine_provider(kernel: str, w: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    from engine.optim.functional import prediction_coeff
    from triton_kernels.adam import fused_adam_update
    from triton_kernels.sgd import fused_sgd_update

    if kernel == "adam":
        m = torch.zeros_like(w, dtype=torch.float32)
        v = torch.zeros_like(w, dtype=torch.float32)
        step = torch.zeros((), dtype=torch.float32, device=w.device)

        def run() -> None:
            fused_adam_update(
                w, g, m, v, None, step=step, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                weight_decay=0.0, decoupled=False, amsgrad=False, maximize=False,
            )

        return run
    buf = torch.zeros_like(w, dtype=torch.float32)
    with_extras = kernel == "sgd_sc_pred"
    predicted = torch.empty_like(w) if with_extras else None
    coeff = prediction_coeff("linear", LR, MOMENTUM, DELAY) if with_extras else 0.0

    def run() -> None:
        fused_sgd_update(
            w, g, buf, lr=LR, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
            nesterov=False, maximize=False, init_momentum=False,
            sc_delay=DELAY if with_extras else 0, predicted=predicted, predict_coeff=coeff,
        )

    return run


def _torch_optim_provider(kernel: str, w: torch.Tensor, g: torch.Tensor, mode: str) -> Callable[[], None]:
    param = torch.nn.Parameter(w)
    param.grad = g
    flag = {"foreach": True} if mode == "foreach" else {"fused": True}
    if kernel == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD([param], lr=LR, momentum=MOMENTUM, **flag)
    else:
        opt = torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS, **flag)
    opt.step()  # creates the state, so the timed steps are steady-state steps
    return opt.step


def _composition_provider(w: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """SGD + spike compensation + linear prediction as a careful user writes it in plain torch."""
    from engine.optim.functional import prediction_coeff, spike_coeffs

    a, b = spike_coeffs(MOMENTUM, DELAY)
    coeff = prediction_coeff("linear", LR, MOMENTUM, DELAY)
    v = torch.zeros_like(w, dtype=torch.float32)
    predicted = torch.empty_like(w)
    ws, gs, vs, ps = [w], [g], [v], [predicted]
    cast = w.dtype != torch.float32

    def run() -> None:
        g32 = torch._foreach_mul([x.float() for x in gs] if cast else gs, 1.0)
        torch._foreach_mul_(vs, MOMENTUM)
        torch._foreach_add_(vs, g32)
        torch._foreach_mul_(g32, b)
        torch._foreach_add_(g32, vs, alpha=a)
        w32 = [x.float() for x in ws] if cast else ws
        torch._foreach_add_(w32, g32, alpha=-LR)
        if cast:
            torch._foreach_copy_(ws, w32)
        torch._foreach_copy_(ps, torch._foreach_add(w32, vs, alpha=-coeff))

    run.momentum, run.predicted = v, predicted  # type: ignore[attr-defined]  # for the fairness test
    return run


def providers(kernel: str) -> tuple[str, ...]:
    if kernel == "sgd_sc_pred":
        return ("engine", "torch_composition")
    return ("engine", "torch_foreach", "torch_fused")


@dataclass
class RatioPlan:
    """How the paired engine-vs-peer ratios are measured (bench/harness.py)."""

    rounds: int = 15
    warmup: int = 2
    inner: int | None = None  # None: calibrate blocks to min_time
    min_time: float = 0.02


def ratio_peer(kernel: str, available: list[str]) -> str:
    """The peer a ratio is claimed against: the composition for SGD+SC+pred, else torch's
    fastest path that ran (fused on CUDA, foreach otherwise)."""
    for peer in ("torch_composition", "torch_fused", "torch_foreach"):
        if peer in available:
            return peer
    raise ValueError(f"{kernel}: no peer among the providers that ran ({available})")


def run_sweep(
    device: torch.device, sizes: list[int], dtypes: list[str], kernels: list[str], rep_ms: int,
    plan: RatioPlan | None = None,
) -> tuple[list[Row], list[RatioRow]]:
    """Bandwidth rows (common.Row, one per provider) and paired ratio rows engine/peer.

    The bandwidth numbers are do_bench medians per provider (L2 flushed between runs on a
    GPU); every *ratio* comes from alternating paired rounds of engine and peer (no L2 flush
    there: both sides run back to back on their own buffers), as the project's rule asks.
    """
    plan = plan or RatioPlan()
    name, vers = device_name(device), versions()
    rows: list[Row] = []
    ratios: list[RatioRow] = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        esize = torch.tensor([], dtype=dtype).element_size()
        for size in sizes:
            numel = max(1, size // esize)
            src = torch.randn(numel, device=device).to(dtype)
            dst = torch.empty_like(src)
            med, p20, p80 = measure(lambda dst=dst, src=src: dst.copy_(src), device, rep_ms=rep_ms)
            copy_gbps = traffic_bytes("copy", numel, esize, esize) / med / 1e6
            rows.append(Row("copy", "torch", dtype_name, size, numel, med, p20, p80, copy_gbps, 100.0, name, **vers))
            del src, dst
            for kernel in kernels:
                fns: dict[str, Callable[[], None]] = {}
                for provider in providers(kernel):
                    w = torch.randn(numel, device=device).to(dtype)
                    g = (torch.randn(numel, device=device) * 1e-2).to(dtype)
                    if provider == "engine":
                        fn = _engine_provider(kernel, w, g)
                        state_bytes = 4
                    elif provider == "torch_composition":
                        fn = _composition_provider(w, g)
                        state_bytes = 4
                    else:
                        if provider == "torch_fused" and device.type != "cuda":
                            continue  # torch's fused optimizers are CUDA-only for bf16 and pointless to time on CPU
                        fn = _torch_optim_provider(kernel, w, g, provider.removeprefix("torch_"))
                        state_bytes = esize  # torch keeps state in the param dtype
                    med, p20, p80 = measure(fn, device, rep_ms=rep_ms)
                    gbps = traffic_bytes(kernel, numel, esize, state_bytes) / med / 1e6
                    rows.append(Row(kernel, provider, dtype_name, size, numel, med, p20, p80, gbps,
                                    100.0 * gbps / copy_gbps, name, **vers))
                    print(f"{kernel:12s} {provider:18s} {dtype_name:5s} {format_size(size):>7s} "
                          f"{med:9.4f} ms {gbps:8.1f} GB/s {100 * gbps / copy_gbps:6.1f}% of copy", flush=True)
                    fns[provider] = fn
                    if provider == "engine":
                        engine_pct = 100.0 * gbps / copy_gbps
                    del w, g, fn
                peer = ratio_peer(kernel, list(fns))
                res = paired(fns["engine"], fns[peer], rounds=plan.rounds, warmup=plan.warmup,
                             inner=plan.inner, min_time=plan.min_time, device=device)
                ratios.append(res.row(
                    "optim", f"{kernel} {dtype_name} {format_size(size)}", "engine", peer,
                    extra={"size_bytes": size, "engine_pct_of_copy": engine_pct},
                ))
                print(summary_line(ratios[-1]), flush=True)
                del fns
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, ratios


def summarize(rows: list[Row], ratios: list[RatioRow]) -> list[str]:
    """The targets of the optimizer issue: bandwidth vs copy, and the paired time ratios
    engine/peer (below 1: the engine is faster)."""
    lines = [
        f"sgd+SC+pred {r.dtype} {format_size(r.size_bytes)}: {r.pct_of_copy:.1f}% of copy bandwidth"
        for r in rows if r.kernel == "sgd_sc_pred" and r.provider == "engine"
    ]
    return lines + [summary_line(r) for r in ratios]


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.kernel, r.dtype) for r in rows if r.kernel != "copy"})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (kernel, dtype) in zip(axes[0], panels, strict=True):
        series = [(r.kernel, r.provider) for r in rows if r.dtype == dtype and r.kernel in (kernel, "copy")]
        for kern, provider in dict.fromkeys(series):
            pts = sorted((r.size_bytes, r.gbps) for r in rows
                         if r.dtype == dtype and r.kernel == kern and r.provider == provider)
            style = "k--" if kern == "copy" else "o-"
            ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], style, label="copy" if kern == "copy" else provider)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("weight buffer (MiB)")
        ax.set_ylabel("effective GB/s")
        ax.set_title(f"{kernel} {dtype}")
        ax.legend(fontsize=7)
    fig.suptitle(rows[0].device, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for optim.csv and optim.png")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default=None, help=f"comma list of weight-buffer sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement")
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds per engine/peer ratio")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes ({SMOKE_SIZES}), 3 rounds of 1 call: checks the harness")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/optim.py: no CUDA GPU here; nothing measured (use --device cpu --smoke to check the harness)")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_kernels is imported
    kernels = args.kernels.split(",")
    dtypes = args.dtypes.split(",")
    for k in kernels:
        if k not in KERNELS:
            parser.error(f"--kernels: unknown kernel {k!r}; choose from {', '.join(KERNELS)}")
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    sizes = [parse_size(s) for s in (args.sizes or (SMOKE_SIZES if args.smoke else DEFAULT_SIZES)).split(",")]

    device = torch.device(args.device)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    plan = RatioPlan(rounds=3, warmup=1, inner=1) if args.smoke else RatioPlan(rounds=args.rounds)
    rows, ratios = run_sweep(device, sizes, dtypes, kernels, args.rep_ms if not args.smoke else 10, plan)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "optim.csv")
    write_ratio_csv(ratios, args.out / "optim_ratios.csv")
    plot(rows, args.out / "optim.png")
    for line in summarize(rows, ratios):
        print(line)
    print(f"wrote {args.out / 'optim.csv'}, {args.out / 'optim_ratios.csv'} and {args.out / 'optim.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
