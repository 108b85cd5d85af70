"""Host time of an engine optimizer step against its parameter count (kernel launches stubbed).

Why: on a GPU a stage's update is a few kernel launches, and everything the optimizer does on
the host around them -- option checks, dispatch, state and layout lookups -- is paid per step
whatever the parameter sizes. Issue 10 asks that host work not grow with the number of
parameters. Here the Triton launches are replaced by a no-op (``kernel[grid](...)`` returns at
once), so what is timed is the Python side of ``opt.step()`` alone, on any machine.

Cases, each a paired ratio (bench/harness.py: alternating rounds, median with a 95 %
interval): the same optimizer over ``--many`` parameters (candidate) against ``--few``
(peer), 64 elements each, SGD with spike compensation and linear prediction and Adam with
linear prediction, on

* ``flat``: parameters in one arena bucket (``engine.flatten_``: a stage's steady state, one
  launch per group);
* ``tensors``: plain parameters (the multi-tensor path: one launch per dtype signature).

A ratio of 1 means the host time does not depend on the parameter count; the per-step times
are in the CSV (``candidate_ms``/``peer_ms``).

And side by side with torch (``vs torch fused`` cases, issue 22: on the H100 a 16 MiB engine
step took 78 us against torch fused's 45 us, host time): the engine's flat step (one bucket,
launches stubbed) against ``torch.optim.<X>(fused=True)`` on the same ``--few`` CPU parameters
of 64 elements, one intra-op thread, so that torch's fused CPU kernel costs next to nothing
and what is compared is the host work per step (torch's is its step plus one kernel call).
A ratio <= 1 is the goal.

With ``--device cuda`` the same cases run on CUDA tensors with the kernels really launched
(nothing stubbed; ``torch.cuda.synchronize`` around every timed block): at 64 elements a
parameter the GPU work is a few microseconds, so a step's time is its host work plus the
launches -- the engine's Triton launches against torch's fused kernel, in the same run.

    python bench/host_cost.py --out /tmp/host                 # 15 rounds, CPU, stubbed
    python bench/host_cost.py --quick --out /tmp/host         # smoke run
    python bench/host_cost.py --device cuda --out /tmp/host   # GPU, real launches
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def _device_argument(argv: Sequence[str]) -> str:
    """``--device`` of a command line, read before torch is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    return pre.parse_known_args(list(argv))[0].device


if __name__ == "__main__" and _device_argument(sys.argv[1:]) == "cpu":
    # (as a script only: an importer's environment stays its own) no GPU needed on the
    # CPU: nothing is launched; on CUDA the kernels are compiled and launched for real
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RatioRow, paired, summary_line, write_ratio_csv  # noqa: E402

import engine  # noqa: E402
import engine.optim as eo  # noqa: E402
from engine.triton_kernels import adam as _adam  # noqa: E402
from engine.triton_kernels import nadam as _nadam  # noqa: E402
from engine.triton_kernels import sgd as _sgd  # noqa: E402

try:  # the launcher module of Adam and NAdam (engines before it launched from adam/nadam.py)
    from engine.triton_kernels import adaptive as _adaptive  # noqa: E402
except ImportError:
    _adaptive = _adam

# (module whose launcher reads the kernel, its name there), current names then older ones
KERNELS = ((_sgd, "_sgd_kernel"), (_sgd, "_sgd_multi_kernel"), (_adaptive, "_adam_kernel"),
           (_adaptive, "_adam_multi_kernel"), (_adaptive, "_nadam_kernel"),
           (_adaptive, "_nadam_multi_kernel"),
           (_sgd, "sgd_kernel"), (_sgd, "sgd_multi_kernel"), (_adam, "adam_kernel"),
           (_adam, "adam_multi_kernel"), (_nadam, "nadam_kernel"), (_nadam, "nadam_multi_kernel"))


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Every optimizer kernel a no-op inside the block (restored after)."""
    saved = [(module, name, getattr(module, name)) for module, name in KERNELS
             if hasattr(module, name)]  # (older engines have no multi-tensor kernels)
    try:
        for module, name, _ in saved:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


CPU = torch.device("cpu")


def launches(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On the CPU every optimizer kernel stubbed (host time only); on CUDA the real ones."""
    return stubbed_launches() if device.type == "cpu" else contextlib.nullcontext()


OPTIMIZERS = {
    "sgd+sc+lwp": lambda ps: eo.SGD(ps, lr=0.1, momentum=0.9, spike_compensation=True, delay=2,
                                    prediction="linear", fused=True),
    "adam+pred": lambda ps: eo.Adam(ps, lr=0.1, delay=2, prediction="linear", fused=True),
}


def stepper(n: int, flat: bool, make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
            device: torch.device = CPU) -> Callable[[], None]:
    torch.manual_seed(0)
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64, device=device))
                                     for _ in range(n)])
    if flat:
        engine.flatten_(params)  # .grad becomes a view of the bucket's flat gradient
    ps = list(params.parameters())
    for p in ps:
        if p.grad is None:
            p.grad = torch.randn_like(p)
        else:
            p.grad.copy_(torch.randn_like(p))
    opt = make(ps)
    for _ in range(2):
        opt.step()  # state created, layouts cached
    return opt.step


#: engine optimizer -> the torch.optim optimizer it stands in for, same options, fused
VS_TORCH = {
    "sgd": (lambda ps: eo.SGD(ps, lr=0.1, momentum=0.9, fused=True),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)),
    "adam": (lambda ps: eo.Adam(ps, lr=0.1, fused=True),
             lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True)),
    "adamw": (lambda ps: eo.AdamW(ps, lr=0.1, fused=True),
              lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)),
}


def torch_stepper(n: int, make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                  device: torch.device = CPU) -> Callable[[], None]:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = make(ps)
    for _ in range(2):
        opt.step()
    return opt.step


def run_vs_torch(*, n: int, rounds: int, min_time: float, label: str,
                 log: Callable[[str], None] = print, device: torch.device = CPU) -> list[RatioRow]:
    """Engine flat step vs torch fused, same n parameters: on the CPU the engine's launches
    stubbed and one thread; on CUDA both launching their kernels."""
    rows = []
    threads = torch.get_num_threads()
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(1)
    note = ("engine launches stubbed; torch fused on CPU, 1 thread, 64-element params" if cpu
            else "CUDA tensors, kernels launched (engine: Triton; torch: fused), 64-element params")
    try:
        for name, (ours, theirs) in VS_TORCH.items():
            with launches(device):
                res = paired(stepper(n, True, ours, device), torch_stepper(n, theirs, device),
                             rounds=rounds, warmup=2, min_time=min_time, device=device)
            rows.append(res.row(
                "host_cost", f"{name} flat vs torch fused", f"engine {n} params",
                f"torch fused {n} params", label=label, note=note,
                extra={"few": n, "many": n, "flat": 1.0},
            ))
            log(summary_line(rows[-1]))
    finally:
        torch.set_num_threads(threads)
    return rows


def run(*, few: int, many: int, rounds: int, min_time: float, label: str,
        log: Callable[[str], None] = print, device: torch.device = CPU) -> list[RatioRow]:
    rows = []
    note = ("kernel launches stubbed: host time of opt.step() only" if device.type == "cpu"
            else "CUDA tensors, kernels launched: host time and launches of opt.step()")
    for name, make in OPTIMIZERS.items():
        for flat in (True, False):
            path = "flat" if flat else "tensors"
            with launches(device):
                res = paired(stepper(many, flat, make, device), stepper(few, flat, make, device),
                             rounds=rounds, warmup=2, min_time=min_time, device=device)
            rows.append(res.row(
                "host_cost", f"{name} {path}", f"{many} params", f"{few} params", label=label,
                note=note,
                extra={"few": few, "many": many, "flat": float(flat)},
            ))
            log(summary_line(rows[-1]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--few", type=int, default=8)
    ap.add_argument("--many", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true", help="3 rounds, short blocks")
    ap.add_argument("--label", default="")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: launches stubbed (default); cuda: CUDA tensors, real launches")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_cost: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing measured, nothing written")
        return 0
    device = torch.device(args.device)
    rounds, min_time = (3, 0.01) if args.quick else (args.rounds, args.min_time)
    rows = run(few=args.few, many=args.many, rounds=rounds, min_time=min_time, label=args.label,
               device=device)
    rows += run_vs_torch(n=args.few, rounds=rounds, min_time=min_time, label=args.label,
                         device=device)
    args.out.mkdir(parents=True, exist_ok=True)
    write_ratio_csv(rows, args.out / "host_cost.csv")
    print(f"wrote {args.out / 'host_cost.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
