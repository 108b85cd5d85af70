"""Optimizer-step benchmark: engine.optim's step() against torch's fused and foreach optimizers,
the plain-torch composition and an independent CuPy kernel, with bytes per parameter.

An optimizer step is memory-bound: it reads weights, gradients and state and writes weights
and state back. So every ratio is printed beside the bytes per parameter each side moves:
counted (``count_traffic``: the tensors every aten operator of one step reads and writes)
for the sides that run as torch operators -- torch's optimizers, the composition, and the
engine's CPU reference path -- and the kernel's traffic model (each stream read or written
once) for the Triton and CuPy kernels, which a dispatch mode cannot see. The device's copy
bandwidth, measured in the same run, is the yardstick.

Sides (each over the same TENSORS=8 parameters of the case's total size):

* ``engine``: ``engine.optim.SGD/Adam/AdamW(...).step()`` as a user calls it, over the
  parameters after ``engine.flatten_`` put them in one arena bucket (so one update per step
  over the flat buffers: Triton on CUDA, the reference path on CPU). Checked to be a flat
  update (one state buffer for all parameters).
* ``torch_fused`` / ``torch_foreach``: ``torch.optim.SGD/Adam/AdamW(fused=True)`` /
  ``(foreach=True)``; torch 2.13 has fused SGD/Adam/AdamW on CPU too, its fastest CPU path.
  Their state is in the parameter dtype (bf16 state for bf16 parameters; the engine keeps fp32
  by default, bf16 in the ``*_bf16st`` cases below).
* ``torch_composition`` (sgd_sc_pred): SGD + spike compensation + linear prediction written
  carefully in plain torch over flat buffers, in place, no temporaries (4 passes in fp32, 5
  with a persistent fp32 scratch for bf16 weights, which are rounded once as in the engine).
* ``cupy_elementwise`` (sgd_sc_pred, CUDA, fp32): the same math as one hand-written
  ``cupy.ElementwiseKernel`` (bench/cupy_peer.py), only when cupy imports and
  ``cupy.cuda.is_available()``; otherwise skipped with the reason printed.
* ``torch_fused_adamw+pred`` (adamw_sc_pred): torch's fused AdamW, then the prediction as a
  separate in-place pass, w_hat = w - H * (lr * update) with lr * update = w_old - w_new the
  step AdamW applied: copy w into w_hat before the step, one ``lerp`` after it. No spike
  compensation (torch has none): different math by design, the ratio prices doing SC and the
  prediction inside the update.

Cases ``sgd_bf16st``, ``adam_bf16st``, ``adamw_bf16st`` (bf16 weights only): the engine with
``state_dtype="param"`` (bf16 moments, rounded once per step: torch fused's 10 / 14 B/param
instead of the default's 14 / 22) against the same torch peers; checked against
``engine.optim.functional`` with bf16 state.

Before anything is timed, every side runs 3 steps on a small buffer (with a larger lr, so
every term moves the weights by more than a bf16 ulp) and its weights and predictions are
compared with ``engine.optim.functional`` (fp32: rtol 1e-5, atol 1e-6; bf16: rtol 2e-2, atol
2 ulps of the largest weight; 1 + H times that for predictions): a peer that does not compute
what it claims is excluded from timing and named (``EXCLUDED ...``); the engine failing its
check stops the run. (This catches torch 2.12/2.13's CPU fused SGD, which skips the vectorised
part of bf16/fp16 updates: pytorch/pytorch#191763.)

Outputs: ``optim.csv`` (common.Row: bandwidth per side for the plot; GB/s counts the minimal
bytes of the update in that side's dtypes, so sides are compared on useful work),
``optim_ratios.csv`` (bench/harness.py's ratio schema: engine/peer time ratios from
alternating paired rounds, median and 95 % interval; ``extra`` holds both sides' bytes/param),
``optim.png``. On CUDA with cupy, ``cupyx.profiler.benchmark`` times the engine's step a
second, independent way (rows ``engine@cupyx.profiler``; CUDA events, no L2 flush).

    python bench/optim.py --out bench/results                    # GPU: 1 MiB .. 1 GiB
    python bench/optim.py --device cpu --out /tmp/o              # CPU: 1, 16, 64 MiB
    python bench/optim.py --device cpu --quick --out /tmp/o      # CPU smoke run (64 KiB, 3 rounds)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy_peer  # noqa: E402
from common import Row, device_name, format_size, measure, parse_size, versions, write_csv  # noqa: E402
from harness import RatioRow, paired, summary_line, write_ratio_csv  # noqa: E402
from outputs import DEFAULT_OUT  # noqa: E402

import engine  # noqa: E402
from engine.optim import functional  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: ``*_bf16st``: the engine with ``state_dtype="param"`` (bf16 weights keep bf16 moments, torch
#: fused's layout: 10 / 14 B/param) against the same torch peers; bf16 runs only
LOW_STATE = "_bf16st"
KERNELS = ("sgd", "sgd_sc_pred", "adam", "adamw", "adamw_sc_pred",
           "sgd" + LOW_STATE, "adam" + LOW_STATE, "adamw" + LOW_STATE)


def base_kernel(kernel: str) -> str:
    """The update a kernel name runs (``adam_bf16st`` -> ``adam``)."""
    return kernel[: -len(LOW_STATE)] if kernel.endswith(LOW_STATE) else kernel


def runs_for(kernel: str, dtype: torch.dtype) -> bool:
    """The low-state cases only mean something for bf16 weights (fp32 state either way)."""
    return not kernel.endswith(LOW_STATE) or dtype == torch.bfloat16
DEFAULT_SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB"
CPU_SIZES = "1MiB,16MiB,64MiB"
QUICK_SIZES = "64KiB"
TENSORS = 8  # parameters per case; the engine's sit in one flat bucket
CHECK_NUMEL = 4000
CHECK_STEPS = 3
CHECK_WEIGHT_SCALE = 0.1

LR, MOMENTUM, DELAY = 1e-3, 0.9, 4
BETAS, EPS = (0.9, 0.999), 1e-8
WEIGHT_DECAY = 1e-2  # AdamW's (torch's default); the SGD and Adam cases use none

#: time-ratio goals of the issue (GPU, fp32): engine/peer at most this
GOALS = {
    ("sgd", "torch_fused"): 1.0,
    ("adam", "torch_fused"): 1.0,
    ("adamw", "torch_fused"): 1.0,
    ("adamw_sc_pred", "torch_fused_adamw+pred"): 1 / 1.5,
    # issue 22: with bf16 moments, at least as fast as torch fused on bf16 weights
    ("sgd" + LOW_STATE, "torch_fused"): 1.0,
    ("adam" + LOW_STATE, "torch_fused"): 1.0,
    ("adamw" + LOW_STATE, "torch_fused"): 1.0,
}
COPY_GOAL_PCT = 92.0  # fused SGD+SC+LWP, fp32, >= 256 MiB: % of same-run copy bandwidth


@dataclass(frozen=True)
class Hyper:
    """Optimizer settings of a run; the prediction horizon H is the delay D."""

    lr: float = LR
    momentum: float = MOMENTUM
    delay: int = DELAY
    betas: tuple[float, float] = BETAS
    eps: float = EPS
    weight_decay: float = WEIGHT_DECAY

    @property
    def horizon(self) -> float:
        return float(self.delay)


TIMED = Hyper()
#: the correctness check: same options, larger lr, so that every term of the update
#: (momentum, spike compensation, decay, prediction) shows beyond a bf16 ulp
CHECKED = Hyper(lr=5e-2)


def traffic_bytes(kernel: str, numel: int, param_bytes: int, state_bytes: int) -> int:
    """Minimal bytes of one update: weights read+written, gradients read, state read+written,
    predicted weights written (what one fused pass moves; the yardstick of GB/s)."""
    p, s = param_bytes, state_bytes
    per = {
        "copy": 2 * p,
        "sgd": 3 * p + 2 * s,
        "sgd_sc_pred": 4 * p + 2 * s,
        "adam": 3 * p + 4 * s,
        "adamw": 3 * p + 4 * s,
        "adamw_sc_pred": 4 * p + 4 * s,
    }
    if base_kernel(kernel) not in per:
        raise ValueError(f"unknown kernel {kernel!r}")
    return numel * per[base_kernel(kernel)]


# ------------------------------------------------------------------------------ bytes moved

#: mutated arguments these ops only write (their old values are never read)
_WRITE_ONLY = {"aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::_foreach_zero_",
               "aten::fill_", "aten::_foreach_fill_"}
#: arguments torch's fused optimizers declare mutable but write only to unscale (grad_scale)
_UNSCALE_ONLY = {"aten::_fused_sgd_": "grads", "aten::_fused_adam_": "grads",
                 "aten::_fused_adamw_": "grads"}
#: ops that allocate without touching memory
_NO_TRAFFIC = {"aten::empty_like", "aten::empty", "aten::empty_strided", "aten::new_empty",
               "aten::new_empty_strided"}


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def count_traffic(fn: Callable[[], object]) -> tuple[int, int]:
    """(bytes, aten ops) of one call of ``fn`` as torch executes it: every aten operator's
    tensor arguments read once and its written tensors (in-place ``self``, ``out=``, fresh
    outputs) written once, from the operator schemas (TorchDispatchMode). View ops and bare
    allocations move nothing. It sees torch ops only: a Triton or CuPy kernel is invisible to
    it, so those sides report their kernel's traffic model instead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    total = {"bytes": 0, "ops": 0}

    class Traffic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            if schema.name in _NO_TRAFFIC:
                return out
            rets = schema.returns
            if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
                return out  # a view: no data moves
            read: dict[int, int] = {}
            written: dict[int, int] = {}
            skip_write = _UNSCALE_ONLY.get(schema.name) if kwargs.get("grad_scale") is None else None
            for i, arg in enumerate(schema.arguments):
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                ts = _tensors(value)
                mutated = arg.alias_info is not None and arg.alias_info.is_write
                write_only = arg.is_out or schema.name in _WRITE_ONLY
                for t in ts:
                    key, n = t.data_ptr() ^ (t.numel() << 1), t.numel() * t.element_size()
                    if mutated and arg.name != skip_write:
                        written[key] = n
                        if not write_only:
                            read[key] = n
                    else:
                        read[key] = n
            for t in _tensors(out):
                key = t.data_ptr() ^ (t.numel() << 1)
                written.setdefault(key, t.numel() * t.element_size())
            total["bytes"] += sum(read.values()) + sum(written.values())
            total["ops"] += 1
            return out

    with Traffic():
        fn()
    return total["bytes"], total["ops"]


# ------------------------------------------------------------------------------ the sides


@dataclass
class Provider:
    """One side of a comparison, built over its own tensors and already stepped once (so its
    state exists and timed steps are steady-state steps)."""

    name: str
    step: Callable[[], object]
    bytes_per_param: float  # traffic model of this formulation (reads + writes)
    how: str  # the passes the bytes come from
    state_bytes: int  # bytes of one state element (for the minimal-traffic GB/s)
    weights: Callable[[], Tensor]  # all weights, flat, fp32 copy
    predicted: Callable[[], Tensor] | None
    set_grads: Callable[[Tensor], None]  # write a flat gradient of all parameters
    applies_sc: bool = True  # *_sc_pred: whether it applies spike compensation
    note: str = ""
    #: its formulation runs as aten ops, so count_traffic can count what it moves
    torch_ops: bool = True
    #: "model" (the formulation's traffic model above) or "counted" (count_traffic)
    bytes_source: str = "model"

    def count_bytes(self, numel: int) -> None:
        """Replace the model by the bytes torch's operators actually read and write in one
        step (an extra step), where the side runs as torch ops; say so in ``how``."""
        if not self.torch_ops:
            return
        nbytes, ops = count_traffic(self.step)
        counted = nbytes / numel
        if self.name == "engine" and nbytes == 0:
            # no aten op moved a byte: the step is the fused C++ loop (engine/optim/cpu_loop.py), one pass
            # whose traffic is the model's; count_traffic cannot see inside it
            self.how = f"fused CPU loop (engine._C, one pass): {self.how}"
            return
        if self.name == "engine":
            self.how = (f"reference path: {ops} aten ops; the fused kernel would move "
                        f"{self.bytes_per_param:g}")
        elif abs(counted - self.bytes_per_param) > 0.05 * self.bytes_per_param:
            self.how += f"; counted {counted:.1f} where the model says {self.bytes_per_param:g}"
        self.bytes_per_param, self.bytes_source = counted, "counted"


def _sizes(numel: int) -> list[int]:
    base, extra = divmod(numel, TENSORS)
    return [base + (i < extra) for i in range(TENSORS) if base + (i < extra) > 0]


def make_flat(numel: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0) -> Tensor:
    """Deterministic random values (same seed -> same tensor on a device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(numel, generator=gen, device=device)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(dtype)


def _split(flat: Tensor) -> list[Tensor]:
    return [t.clone() for t in flat.split(_sizes(flat.numel()))]


def _params_with_grads(w: Tensor, g: Tensor) -> list[nn.Parameter]:
    params = [nn.Parameter(t) for t in _split(w)]
    for p, gt in zip(params, _split(g), strict=True):
        p.grad = gt
    return params


def _readers(params: Sequence[Tensor]) -> tuple[Callable[[], Tensor], Callable[[Tensor], None]]:
    sizes = [p.numel() for p in params]

    def weights() -> Tensor:
        return torch.cat([p.detach().float().reshape(-1) for p in params])

    def set_grads(flat: Tensor) -> None:
        for p, chunk in zip(params, flat.split(sizes), strict=True):
            p.grad.copy_(chunk.view_as(p))  # type: ignore[union-attr]

    return weights, set_grads


def _engine_optimizer(kernel: str, params: list[nn.Parameter], h: Hyper) -> torch.optim.Optimizer:
    mitigations = {"delay": h.delay, "spike_compensation": True, "prediction": "linear"}
    if kernel.endswith(LOW_STATE):
        kernel = base_kernel(kernel)
        mitigations["state_dtype"] = "param"
        low = {"state_dtype": "param"}
    else:
        low = {}
    if kernel in ("sgd", "sgd_sc_pred"):
        extra = mitigations if kernel == "sgd_sc_pred" else {}
        return engine.optim.SGD(params, lr=h.lr, momentum=h.momentum, **extra, **low)
    if kernel == "adam":
        return engine.optim.Adam(params, lr=h.lr, betas=h.betas, eps=h.eps, **low)
    extra = mitigations if kernel == "adamw_sc_pred" else low
    return engine.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps,
                              weight_decay=h.weight_decay, **extra)


def engine_provider(kernel: str, w: Tensor, g: Tensor, h: Hyper) -> Provider:
    """engine.optim over the parameters after engine.flatten_: ``opt.step()``."""
    params = _params_with_grads(w, g)
    engine.flatten_(params, name=f"bench-optim-{kernel}")
    opt = _engine_optimizer(kernel, params, h)
    opt.step()
    state = opt.state[params[0]]
    flat_key = "momentum_buffer" if kernel.startswith("sgd") else "exp_avg"
    if len({opt.state[p][flat_key].untyped_storage().data_ptr() for p in params}) != 1:
        raise AssertionError(
            f"engine {kernel}: the parameters' {flat_key} are not views of one flat buffer, so "
            "step() did not run as one flat update over the arena bucket"
        )
    pb = params[0].element_size()
    nbytes, parts = 3 * pb, [f"w r+w, g r ({3 * pb})"]
    for key, t in state.items():
        if key == "step":
            continue
        s = t.element_size()
        per = s if key == "last_update" else 2 * s  # last_update is written, never read
        nbytes += per
        parts.append(f"{key} {'w' if per == s else 'r+w'} ({per})")
    predicting = kernel.endswith("_pred")
    if predicting:
        nbytes += pb
        parts.append(f"w_hat w ({pb})")
    weights, set_grads = _readers(params)

    def predicted() -> Tensor:
        return torch.cat([t.detach().float().reshape(-1) for t in opt.predicted_weights()])

    return Provider("engine", opt.step, nbytes, "1 pass: " + ", ".join(parts),
                    state[flat_key].element_size(), weights, predicted if predicting else None,
                    set_grads, torch_ops=params[0].device.type != "cuda")


def torch_optim_provider(kernel: str, mode: str, w: Tensor, g: Tensor, h: Hyper) -> Provider:
    """torch.optim with ``fused=True`` or ``foreach=True`` over the same parameters."""
    params = _params_with_grads(w, g)
    flag = {"fused": True} if mode == "fused" else {"foreach": True}
    kernel = base_kernel(kernel)
    if kernel == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=h.lr, momentum=h.momentum, **flag)
    elif kernel == "adam":
        opt = torch.optim.Adam(params, lr=h.lr, betas=h.betas, eps=h.eps, **flag)
    elif kernel == "adamw":
        opt = torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps,
                                weight_decay=h.weight_decay, **flag)
    else:
        raise ValueError(f"torch.optim has no {kernel}")
    opt.step()
    p, s = params[0].element_size(), params[0].element_size()  # torch: state in the param dtype
    if mode == "fused":
        nbytes = 3 * p + (2 if kernel == "sgd" else 4) * s
        how = "1 pass (multi-tensor apply)"
    elif kernel == "sgd":
        nbytes = 3 * p + 5 * s
        how = "3 passes: buf*=m, buf+=g, w-=lr*buf"
    else:
        nbytes = 4 * p + 14 * s + (2 * p if kernel == "adamw" else 0)
        how = ("7 passes: " if kernel == "adam" else "8 passes: w*=1-lr*wd, ") + (
            "lerp m, v*=b2, v+=(1-b2)g^2, t=sqrt(v), t/=bc2, t+=eps, w+=-s*m/t")
    weights, set_grads = _readers(params)
    return Provider(f"torch_{mode}", opt.step, nbytes, how, s, weights, None, set_grads)


def composition_provider(kernel: str, w: Tensor, g: Tensor, h: Hyper) -> Provider:
    """SGD + spike compensation + linear prediction as a careful user writes it in plain
    torch: flat buffers, every pass in place or into an existing buffer, no temporaries.

    fp32 (4 passes, 8p + 4s = 48 B/param)::

        v = g + m*v                      torch.add(g, v, alpha=m, out=v)
        w += -lr*bd*g; w += -lr*a*v      two in-place adds
        w_hat = w - c*v                  torch.add(w, v, alpha=-c, out=w_hat)

    bf16 weights (5 passes, 6p + 8s = 44 B/param): the weight update goes through a
    persistent fp32 scratch so the new weights are rounded once, as the engine rounds them.
    """
    if kernel != "sgd_sc_pred":
        raise ValueError("the composition peer computes sgd_sc_pred")
    c = cupy_peer.coefficients(lr=h.lr, momentum=h.momentum, dampening=0.0, weight_decay=0.0,
                               delay=h.delay, horizon=h.horizon)
    a, bd, coeff, m, lr = c["a"], c["bd"], c["c"], h.momentum, h.lr
    wf, gf = w.clone(), g.clone()
    v = torch.zeros_like(wf, dtype=torch.float32)
    pred = torch.empty_like(wf)
    cast = wf.dtype != torch.float32
    scratch = torch.empty_like(wf, dtype=torch.float32) if cast else None

    def step() -> None:
        torch.add(gf, v, alpha=m, out=v)
        if scratch is None:
            wf.add_(gf, alpha=-lr * bd)
            wf.add_(v, alpha=-lr * a)
        else:
            torch.add(wf, gf, alpha=-lr * bd, out=scratch)
            scratch.add_(v, alpha=-lr * a)
            wf.copy_(scratch)
        torch.add(wf, v, alpha=-coeff, out=pred)

    step()
    pb = wf.element_size()
    if cast:
        nbytes, how = 6 * pb + 8 * 4, "5 passes: v=g+m*v, s=w-lr*bd*g, s-=lr*a*v, w=s, w_hat=w-c*v"
    else:
        nbytes, how = 8 * pb + 4 * 4, "4 passes: v=g+m*v, w-=lr*bd*g, w-=lr*a*v, w_hat=w-c*v"

    def set_grads(flat: Tensor) -> None:
        gf.copy_(flat)

    prov = Provider("torch_composition", step, nbytes, how, 4, lambda: wf.float(),
                    lambda: pred.float(), set_grads)
    prov.step.momentum, prov.step.predicted = v, pred  # type: ignore[attr-defined]
    return prov


def cupy_provider(kernel: str, w: Tensor, g: Tensor, h: Hyper) -> Provider:
    """The same update as one CuPy ElementwiseKernel (bench/cupy_peer.py), flat fp32 buffers."""
    if kernel != "sgd_sc_pred":
        raise ValueError("the CuPy peer computes sgd_sc_pred")
    wf, gf = w.clone(), g.clone()
    v = torch.zeros_like(wf)
    pred = torch.empty_like(wf)
    coeffs = cupy_peer.coefficients(lr=h.lr, momentum=h.momentum, dampening=0.0,
                                    weight_decay=0.0, delay=h.delay, horizon=h.horizon)
    step = cupy_peer.sgd_sc_lwp_step(wf, gf, v, pred, coeffs)
    step()

    def set_grads(flat: Tensor) -> None:
        gf.copy_(flat)

    return Provider("cupy_elementwise", step, 4 * 4 + 2 * 4, "1 pass (NVRTC-compiled ElementwiseKernel)",
                    4, lambda: wf.float(), lambda: pred.float(), set_grads, torch_ops=False)


def fused_adamw_pred_provider(kernel: str, w: Tensor, g: Tensor, h: Hyper) -> Provider:
    """torch's fused AdamW, then w_hat = w - H * (w_old - w_new) as a separate in-place pass:
    w_hat <- w before the step (foreach copy), then w_hat = lerp(w_hat, w, 1 + H)
    (= w + H * (w - w_old)); 8p + 4s bytes/param."""
    if kernel != "adamw_sc_pred":
        raise ValueError("the fused AdamW + prediction peer computes adamw_sc_pred (without SC)")
    params = _params_with_grads(w, g)
    opt = torch.optim.AdamW(params, lr=h.lr, betas=h.betas, eps=h.eps,
                            weight_decay=h.weight_decay, fused=True)
    ws = [p.detach() for p in params]
    preds = [torch.empty_like(t) for t in ws]
    weight = 1.0 + h.horizon

    def step() -> None:
        torch._foreach_copy_(preds, ws)
        opt.step()
        torch._foreach_lerp_(preds, ws, weight)

    step()
    p = s = params[0].element_size()
    weights, set_grads = _readers(params)
    return Provider("torch_fused_adamw+pred", step, 8 * p + 4 * s,
                    "3 passes: w_hat=w, fused AdamW, w_hat=lerp(w_hat, w, 1+H)", s, weights,
                    lambda: torch.cat([t.float().reshape(-1) for t in preds]), set_grads,
                    applies_sc=False, note="no spike compensation (torch has none)")


Builder = Callable[[str, Tensor, Tensor, Hyper], Provider]


def builders(kernel: str, device: torch.device, dtype: torch.dtype) -> tuple[dict[str, Builder], dict[str, str]]:
    """The sides of ``kernel`` on this device/dtype, and the skipped ones with the reason."""
    out: dict[str, Builder] = {"engine": engine_provider}
    skipped: dict[str, str] = {}
    if base_kernel(kernel) in ("sgd", "adam", "adamw"):
        out["torch_fused"] = lambda k, w, g, h: torch_optim_provider(k, "fused", w, g, h)
        out["torch_foreach"] = lambda k, w, g, h: torch_optim_provider(k, "foreach", w, g, h)
    elif kernel == "sgd_sc_pred":
        out["torch_composition"] = composition_provider
        ok, why = cupy_peer.status()
        if device.type != "cuda":
            skipped["cupy_elementwise"] = "CuPy runs on CUDA only"
        elif not ok:
            skipped["cupy_elementwise"] = why
        elif dtype != torch.float32:
            skipped["cupy_elementwise"] = "CuPy has no bfloat16; the CuPy peer runs fp32 only"
        else:
            out["cupy_elementwise"] = cupy_provider
    elif kernel == "adamw_sc_pred":
        out["torch_fused_adamw+pred"] = fused_adamw_pred_provider
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return out, skipped


def build_all(kernel: str, device: torch.device, dtype: torch.dtype, numel: int, h: Hyper,
              grad_scale: float, log: Callable[[str], None] = print,
              exclude: Sequence[str] = (), weight_scale: float = 1.0) -> dict[str, Provider]:
    """Every side that can run, each over its own copy of the same weights and gradients."""
    found, skipped = builders(kernel, device, dtype)
    for name, why in skipped.items():
        log(f"  skip {kernel} {name}: {why}")
    out: dict[str, Provider] = {}
    for name, build in found.items():
        if name in exclude:
            continue
        w = make_flat(numel, dtype, device, seed=1, scale=weight_scale)
        g = make_flat(numel, dtype, device, seed=2, scale=grad_scale)
        try:
            out[name] = build(kernel, w, g, h)
        except RuntimeError as exc:
            if name == "engine":
                raise
            log(f"  skip {kernel} {name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return out


# ------------------------------------------------------------------------------ correctness


def reference(kernel: str, applies_sc: bool, w0: Tensor, grads: Sequence[Tensor], h: Hyper) -> tuple[Tensor, Tensor | None]:
    """What a side claims to compute, by engine.optim.functional (the reference math)."""
    w = w0.clone()
    sd = w.dtype if kernel.endswith(LOW_STATE) else functional.state_dtype(w.dtype)
    kernel = base_kernel(kernel)
    pred = torch.empty_like(w) if kernel.endswith("_pred") else None
    sc = h.delay if (applies_sc and kernel.endswith("_sc_pred")) else 0
    if kernel.startswith("sgd"):
        v = torch.zeros_like(w, dtype=sd)
        coeff = functional.prediction_coeff("linear", h.lr, h.momentum, h.horizon) if pred is not None else 0.0
        for k, g in enumerate(grads):
            functional.sgd_update(
                w, g, v, lr=h.lr, momentum=h.momentum, dampening=0.0, weight_decay=0.0,
                nesterov=False, maximize=False, init_momentum=k == 0, sc_delay=sc,
                predicted=pred, predict_coeff=coeff,
            )
    else:
        m, v = torch.zeros_like(w, dtype=sd), torch.zeros_like(w, dtype=sd)
        step = torch.zeros((), dtype=torch.float32, device=w.device)
        decoupled = kernel != "adam"
        for g in grads:
            functional.adam_update(
                w, g, m, v, None, step=step, lr=h.lr, beta1=h.betas[0], beta2=h.betas[1],
                eps=h.eps, weight_decay=h.weight_decay if decoupled else 0.0,
                decoupled=decoupled, amsgrad=False, maximize=False, sc_delay=sc,
                predicted=pred, predict_horizon=h.horizon if pred is not None else 0.0,
            )
    return w, pred


def tolerance(dtype: torch.dtype, want: Tensor, prediction: bool = False) -> dict[str, float]:
    """allclose tolerances of the check against the reference ``want``.

    fp32: rtol 1e-5, atol 1e-6. bf16: rtol 2e-2 and an atol of 2 ulps of the largest weight
    (a rounding tie broken the other way in one step stays as an absolute difference when
    that weight later moves towards zero). A prediction w + H * (w - w_old) amplifies a
    weight's difference by 1 + H, so its tolerance is 1 + H times wider.
    """
    if dtype == torch.float32:
        tol = {"rtol": 1e-5, "atol": 1e-6}
    else:
        tol = {"rtol": 2e-2, "atol": 2.0**-6 * float(want.abs().max())}
    scale = 1.0 + CHECKED.horizon if prediction else 1.0
    return {k: v * scale for k, v in tol.items()}


def check_kernel(kernel: str, device: torch.device, dtype: torch.dtype,
                 log: Callable[[str], None] = print) -> tuple[dict[str, str], dict[str, str]]:
    """Run every side CHECK_STEPS steps on a small buffer and compare it with the reference.

    Returns (notes of the sides that passed, reasons of the peers that failed): a peer that
    does not compute what it claims is excluded from timing, loudly (torch 2.12/2.13's CPU
    fused SGD skips the vectorised part of bf16/fp16 updates, pytorch/pytorch#191763, and
    is caught here). The engine failing its check raises AssertionError: nothing is timed.
    """
    # weights of 0.1 * N(0, 1) and gradients of N(0, 1): every step moves a weight by several
    # bf16 ulps, so a missing term (momentum, SC, decay, prediction) exceeds the tolerance
    w0 = make_flat(CHECK_NUMEL, dtype, device, seed=1, scale=CHECK_WEIGHT_SCALE)
    grads = [make_flat(CHECK_NUMEL, dtype, device, seed=2 + k) for k in range(CHECK_STEPS)]
    sides = build_all(kernel, device, dtype, CHECK_NUMEL, CHECKED, 1.0, log=lambda _m: None,
                      weight_scale=CHECK_WEIGHT_SCALE)
    notes: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, prov in sides.items():
        for g in grads[1:]:  # the builder stepped once, with grads[0]
            prov.set_grads(g)
            prov.step()
        w_ref, pred_ref = reference(kernel, prov.applies_sc, w0, grads, CHECKED)
        worst, problem = 0.0, ""
        pairs = [("weights", prov.weights(), w_ref, tolerance(dtype, w_ref))]
        if pred_ref is not None:
            if prov.predicted is None:
                raise AssertionError(f"{kernel} {name}: claims no prediction")
            pairs.append(("predicted weights", prov.predicted(), pred_ref,
                          tolerance(dtype, w_ref, prediction=True)))
        for what, got, want, tol in pairs:
            want = want.float()
            diff = (got - want).abs().max().item()
            if not torch.allclose(got, want, **tol):
                problem = problem or (
                    f"{what} differ from engine.optim.functional's after {CHECK_STEPS} steps "
                    f"(max |diff| {diff:.3g}, tolerance rtol={tol['rtol']:g} atol={tol['atol']:g})"
                )
            worst = max(worst, diff)
        if problem:
            if name == "engine":
                raise AssertionError(f"{kernel} {dtype_name(dtype)} engine: {problem}")
            failed[name] = f"does not compute what it claims: {problem}"
            continue
        claim = "no SC" if not prov.applies_sc and kernel.endswith("_sc_pred") else "same math"
        notes[name] = f"{claim}, max |diff| {worst:.2g} vs reference"
    log(f"  check {kernel} {dtype_name(dtype)}: " + "; ".join(f"{k} ok ({v})" for k, v in notes.items()))
    for name, why in failed.items():
        log(f"  EXCLUDED {kernel} {dtype_name(dtype)} {name}: {why}; not timed")
    return notes, failed


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


# ------------------------------------------------------------------------------ the sweep


@dataclass
class RatioPlan:
    """How the paired engine-vs-peer ratios are measured (bench/harness.py)."""

    rounds: int = 15
    warmup: int = 2
    inner: int | None = None  # None: calibrate blocks to min_time
    min_time: float = 0.02


def bytes_line(row: RatioRow) -> str:
    e = row.extra
    return (f"{summary_line(row)} | bytes/param {e['candidate_bytes_per_param']:.1f} vs "
            f"{e['peer_bytes_per_param']:.1f} (byte ratio {e['byte_ratio']:.2f})"
            + (f" | goal <= {e['goal_ratio']:.2f}x" if "goal_ratio" in e else ""))


def run_sweep(
    device: torch.device, sizes: list[int], dtypes: list[str], kernels: list[str], rep_ms: int,
    plan: RatioPlan | None = None, label: str = "",
) -> tuple[list[Row], list[RatioRow]]:
    """Bandwidth rows (common.Row, one per side) and paired ratio rows engine/peer for every
    peer that ran.

    The bandwidth numbers are ``common.measure`` medians per side (do_bench, L2 flushed between
    runs, on a GPU); every *ratio* comes from alternating paired rounds of engine and peer
    (no flush there: both sides run back to back on their own buffers).
    """
    plan = plan or RatioPlan()
    name, vers = device_name(device), versions()
    excluded: dict[tuple[str, str, str], str] = {}
    rows: list[Row] = []
    ratios: list[RatioRow] = []
    cupy_ok, cupy_why = cupy_peer.status()
    cross_check = device.type == "cuda" and cupy_ok
    print(f"cupyx.profiler cross-check: {'on' if cross_check else 'off'} "
          f"({cupy_why if device.type == 'cuda' else 'CPU run'})", flush=True)
    for dtype_key in dtypes:
        dtype = DTYPES[dtype_key]
        esize = torch.tensor([], dtype=dtype).element_size()
        kernels_here = [k for k in kernels if runs_for(k, dtype)]
        checks = {k: check_kernel(k, device, dtype) for k in kernels_here}
        excluded.update({(k, dtype_key, n): why for k, (_, bad) in checks.items() for n, why in bad.items()})
        for size in sizes:
            numel = max(TENSORS, size // esize)
            src = torch.randn(numel, device=device).to(dtype)
            dst = torch.empty_like(src)
            med, p20, p80 = measure(lambda dst=dst, src=src: dst.copy_(src), device, rep_ms=rep_ms)
            copy_gbps = traffic_bytes("copy", numel, esize, esize) / med / 1e6
            rows.append(Row("copy", "torch", dtype_key, size, numel, med, p20, p80, copy_gbps, 100.0, name, **vers))
            del src, dst
            for kernel in kernels_here:
                bad = checks[kernel][1]
                sides = build_all(kernel, device, dtype, numel, TIMED, 1e-2, exclude=list(bad),
                                  log=print if size == sizes[0] else (lambda _m: None))
                kernel_bytes = sides["engine"].bytes_per_param
                pct: dict[str, float] = {}
                for prov_name, prov in sides.items():
                    prov.count_bytes(numel)
                    med, p20, p80 = measure(prov.step, device, rep_ms=rep_ms)
                    gbps = traffic_bytes(kernel, numel, esize, prov.state_bytes) / med / 1e6
                    pct[prov_name] = 100.0 * gbps / copy_gbps
                    rows.append(Row(kernel, prov_name, dtype_key, size, numel, med, p20, p80, gbps,
                                    pct[prov_name], name, **vers))
                    print(f"{kernel:13s} {prov_name:22s} {dtype_key:5s} {format_size(size):>7s} "
                          f"{med:9.4f} ms {gbps:8.1f} GB/s {pct[prov_name]:6.1f}% of copy "
                          f"{prov.bytes_per_param:5.1f} B/param {prov.bytes_source} ({prov.how})",
                          flush=True)
                    if prov_name == "engine" and cross_check:
                        cx_ms, n = cupy_peer.profile_gpu_ms(prov.step, n_repeat=20, max_duration=0.3)
                        cx_gbps = traffic_bytes(kernel, numel, esize, prov.state_bytes) / cx_ms / 1e6
                        rows.append(Row(kernel, "engine@cupyx.profiler", dtype_key, size, numel, cx_ms,
                                        cx_ms, cx_ms, cx_gbps, 100.0 * cx_gbps / copy_gbps, name, **vers))
                        print(f"{'':13s} cross-check: do_bench {med:.4f} ms, cupyx.profiler.benchmark "
                              f"{cx_ms:.4f} ms ({n} calls, no L2 flush): x{cx_ms / med:.2f}", flush=True)
                engine_side = sides["engine"]
                for peer_name, peer in sides.items():
                    if peer_name == "engine":
                        continue
                    res = paired(engine_side.step, peer.step, rounds=plan.rounds, warmup=plan.warmup,
                                 inner=plan.inner, min_time=plan.min_time, device=device)
                    extra = {
                        "size_bytes": size,
                        "engine_pct_of_copy": pct["engine"],
                        "peer_pct_of_copy": pct[peer_name],
                        "candidate_bytes_per_param": engine_side.bytes_per_param,
                        "peer_bytes_per_param": peer.bytes_per_param,
                        "byte_ratio": engine_side.bytes_per_param / peer.bytes_per_param,
                        "candidate_bytes_counted": float(engine_side.bytes_source == "counted"),
                        "peer_bytes_counted": float(peer.bytes_source == "counted"),
                        "engine_kernel_bytes_per_param": kernel_bytes,
                    }
                    goal = GOALS.get((kernel, peer_name))
                    if goal is not None and device.type == "cuda" and (
                            dtype == torch.float32 or kernel.endswith(LOW_STATE)):
                        extra["goal_ratio"] = goal
                    passed = checks[kernel][0]
                    note = (f"check: engine {passed['engine']}; {peer_name} "
                            f"{passed.get(peer_name, 'not checked')}; engine: "
                            f"{engine_side.how}; {peer_name}: {peer.how}"
                            + (f"; {peer.note}" if peer.note else ""))
                    ratios.append(res.row("optim", f"{kernel} {dtype_key} {format_size(size)}", "engine",
                                          peer_name, label=label, note=note, extra=extra))
                    print(bytes_line(ratios[-1]), flush=True)
                del sides, engine_side
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for (kernel, dtype_key, peer_name), why in excluded.items():
        print(f"EXCLUDED {kernel} {dtype_key} {peer_name}: {why}", flush=True)
    return rows, ratios


def summarize(rows: list[Row], ratios: list[RatioRow]) -> list[str]:
    """The issue's goals: bandwidth vs copy, and every paired time ratio engine/peer (below 1:
    the engine is faster) with both sides' bytes/param."""
    lines = [
        f"sgd+SC+pred {r.dtype} {format_size(r.size_bytes)}: {r.pct_of_copy:.1f}% of copy bandwidth"
        + (f" (goal >= {COPY_GOAL_PCT:.0f}%)" if r.dtype == "fp32" and r.size_bytes >= 256 << 20 else "")
        for r in rows if r.kernel == "sgd_sc_pred" and r.provider == "engine"
    ]
    return lines + [bytes_line(r) for r in ratios]


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [k for k in KERNELS if any(r.kernel == k for r in rows)]
    dtypes = [d for d in DTYPES if any(r.dtype == d for r in rows)]
    fig, axes = plt.subplots(len(dtypes), len(kernels), figsize=(4.2 * len(kernels), 3.6 * len(dtypes)),
                             squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, kernel in enumerate(kernels):
            ax = axes[i][j]
            series = [(r.kernel, r.provider) for r in rows if r.dtype == dtype and r.kernel in (kernel, "copy")]
            for kern, provider in dict.fromkeys(series):
                pts = sorted((r.size_bytes, r.gbps) for r in rows
                             if r.dtype == dtype and r.kernel == kern and r.provider == provider)
                style = "k--" if kern == "copy" else "o-"
                ax.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], style,
                        label="copy" if kern == "copy" else provider)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("weight buffer (MiB)")
            ax.set_ylabel("effective GB/s")
            ax.set_title(f"{kernel} {dtype}")
            ax.legend(fontsize=6)
    fig.suptitle(rows[0].device, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for optim.csv, optim_ratios.csv and optim.png")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sizes", default=None,
                        help=f"comma list of total weight sizes (default {DEFAULT_SIZES} on CUDA, "
                        f"{CPU_SIZES} on CPU)")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    parser.add_argument("--rep-ms", type=int, default=100, help="timing budget per bandwidth measurement")
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds per engine/peer ratio")
    parser.add_argument("--label", default="", help="machine label for the ratio CSV")
    parser.add_argument("--quick", "--smoke", dest="quick", action="store_true",
                        help=f"smoke run: {QUICK_SIZES}, 3 rounds of 1 call (checks the script)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/optim.py: no CUDA GPU here; nothing measured (use --device cpu, or "
              "--device cpu --quick to check the script)")
        return 0
    kernels = args.kernels.split(",")
    dtypes = args.dtypes.split(",")
    for k in kernels:
        if k not in KERNELS:
            parser.error(f"--kernels: unknown kernel {k!r}; choose from {', '.join(KERNELS)}")
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    default_sizes = QUICK_SIZES if args.quick else (CPU_SIZES if args.device == "cpu" else DEFAULT_SIZES)
    sizes = [parse_size(s) for s in (args.sizes or default_sizes).split(",")]

    device = torch.device(args.device)
    plan = RatioPlan(rounds=3, warmup=1, inner=1) if args.quick else RatioPlan(rounds=args.rounds)
    rows, ratios = run_sweep(device, sizes, dtypes, kernels, 10 if args.quick else args.rep_ms,
                             plan, label=args.label)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "optim.csv")
    write_ratio_csv(ratios, args.out / "optim_ratios.csv")
    plot(rows, args.out / "optim.png")
    print()
    for line in summarize(rows, ratios):
        print(line)
    print(f"wrote {args.out / 'optim.csv'}, {args.out / 'optim_ratios.csv'} and {args.out / 'optim.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
