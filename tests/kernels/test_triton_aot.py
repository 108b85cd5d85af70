"""Ahead-of-time compilation of the optimizer kernels for sm_90, as a GPU launch compiles them.

The interpreter runs kernel bodies as numpy code, so it misses whatever only the real
compiler sees: type errors in constexpr branches, unsupported ops, layouts, vector widths.
``triton.compile`` for a CUDA target needs no GPU, only the bundled ptxas. It must run where
TRITON_INTERPRET is unset (the conftest sets it here), hence the subprocesses.

What is compiled is what a launch would compile: each case calls the real launcher
(``launch_sgd`` / ``launch_adam`` / ``launch_nadam``) on meta tensors, so the constexpr flags, block size, warps,
placeholder pointers and dtypes are the launcher's own, and Triton's own binder (built for the
CUDA backend) turns the arguments into the signature and specialization of a GPU launch:
``tt.divisibility=16`` for 16-byte aligned pointers and for ints divisible by 16, i64 for
n >= 2**31, n == 1 as a constant. Each distinct variant is compiled once to PTX and a cubin.

Checked on the PTX: IEEE-rounded division and square root only (approximate ones would
break agreement with the reference); on the arena path (every pointer 16-byte aligned, n a
multiple of 16) every block access is vectorized to the expected width (fp32: 128 bits;
bf16/fp16: 128 bits where all swept tensors are 16-bit, 64 bits beside fp32 tensors, see
triton_kernels/_launch.py); and no variant the launchers pick goes through shared memory.

The default set (152 cases; NAdam's 24 of them: every dtype pair off and on, the host path,
odd and unaligned sizes; 14 with the moments in the 16-bit param dtype, state_dtype="param"; ~25 CPU-s: ~15-40 s on 2 cores) covers every dtype pair, each flag
alone (delay compensation ``dc`` with the delta it reads), everything on, and the unhinted,
i64 and n == 1 specializations, and five multi-tensor launches (triton_kernels/multi.py: each
kernel with everything on, aligned, and one unaligned); the ``slow`` sweep (2,130 cases, ~5 CPU-min; only with
``PE_AOT_SWEEP=1``, which .ci/run sets for a second pytest call so the default suite stays
near 10 minutes) adds SGD's full flag product per dtype, Adam's full product of the flags that change memory
traffic (the arithmetic-only flags rotate through their combinations), and the mixed-dtype
pairs with every flag alone, and the multi-tensor kernels over every dtype pair, odd sizes
and each flag alone.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16")
BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
N_ARENA = 4096  # arena buckets are padded to the alignment: n is a multiple of 16
N_ODD = 4099  # a per-tensor launch of an odd-sized tensor: n gets no divisibility hint
N_I64 = 2**31 + 64  # a flat buffer past 2**31 elements: n is an i64
SCALAR_FLAGS = ("scale", "inf", "device_step")  # one-element loads beside the block accesses

SGD_OFF = dict(momentum=False, init=False, nesterov=False, sc=False, wd=False, maximize=False,
               predict=False, delta=False, scale=False, inf=False, dc=False, lr_tensor=False)
SGD_MODES = [dict()] + [dict(momentum=True, init=i, **m) for i in (False, True)
                        for m in (dict(), dict(nesterov=True), dict(sc=True))]
SGD_ON = dict({k: True for k in SGD_OFF}, init=False, nesterov=False)
ADAM_OFF = dict(wd=False, decoupled=False, amsgrad=False, maximize=False, sc=False, last=False,
                predict=False, delta=False, scale=False, inf=False, device_step=False,
                lerp_small=True, dc=False, lr_tensor=False)
ADAM_ON = {k: True for k in ADAM_OFF}
# NAdam: Adam's kernel shape without AMSGrad and spike compensation; device_step also loads
# mu_product
NADAM_OFF = {k: v for k, v in ADAM_OFF.items() if k not in ("amsgrad", "sc")}
NADAM_ON = {k: True for k in NADAM_OFF}
ADAM_TRAFFIC = ("amsgrad", "last", "predict", "delta", "scale", "inf", "device_step")
ADAM_ARITH = [dict(wd=w, decoupled=d, maximize=m, sc=s, lerp_small=ls)
              for w, d in ((False, False), (True, False), (True, True))
              for m in (False, True) for s in (False, True) for ls in (True, False)]


def _case(family, dtype, grad=None, n=N_ARENA, odd=(), block=None, multi=False,
          low_state=False, **opts):
    """``low_state``: the moments in the param dtype (the optimizers' state_dtype="param")."""
    base = {"sgd": SGD_OFF, "adam": ADAM_OFF, "nadam": NADAM_OFF}[family]
    assert set(opts) <= set(base), opts
    return dict(family=family, dtype=dtype, grad=grad or dtype, n=n, odd=list(odd),
                block=block, multi=multi, low_state=low_state, opts=dict(base, **opts))


def _multi(family, dtype, grad=None, n=N_ARENA, odd=(), low_state=False, **opts):
    """A multi-tensor launch (two segments; the kernel derives the step on the device)."""
    if family != "sgd":
        opts["device_step"] = True
    return _case(family, dtype, grad, n=n, odd=odd, multi=True, low_state=low_state, **opts)


def multi_default_cases() -> dict[str, dict]:
    """A handful: every kernel with everything on, aligned (the vectorized path) and one
    unaligned (the scalar path)."""
    return {
        "multi_sgd_float32_on": _multi("sgd", "float32", **SGD_ON),
        "multi_sgd_bfloat16_on": _multi("sgd", "bfloat16", **SGD_ON),
        "multi_adam_float32_on": _multi("adam", "float32", **ADAM_ON),
        "multi_nadam_float32_on": _multi("nadam", "float32", **NADAM_ON),
        "multi_adam_float32_on_unaligned": _multi("adam", "float32", n=N_ODD, odd=["all"],
                                                  **ADAM_ON),
        # state_dtype="param": bf16 moments beside bf16 weights (issue 22)
        "multi_sgd_bfloat16_lowstate_on": _multi("sgd", "bfloat16", low_state=True, **SGD_ON),
        "multi_adam_bfloat16_lowstate_off": _multi("adam", "bfloat16", low_state=True),
    }


def multi_sweep_cases() -> dict[str, dict]:
    cases = {}
    for family, on in (("sgd", SGD_ON), ("adam", ADAM_ON), ("nadam", NADAM_ON)):
        for dtype, grad in itertools.product(DTYPES, DTYPES):
            cases[f"sweep_multi_{family}_{dtype}_{grad}_on"] = _multi(family, dtype, grad, **on)
            cases[f"sweep_multi_{family}_{dtype}_{grad}_off"] = _multi(family, dtype, grad)
        for dtype in DTYPES:
            cases[f"sweep_multi_{family}_{dtype}_on_n_odd"] = _multi(family, dtype, n=N_ODD,
                                                                     **on)
        for name, opts in _singles(family).items():
            if family == "nadam" and name in ("amsgrad", "sc"):
                continue
            cases[f"sweep_multi_{family}_float32_{name}"] = _multi(family, "float32", **opts)
    return cases


def _singles(family):
    if family == "sgd":
        return {("mom_init" if m.get("init") else "mom") + ("_nesterov" if m.get("nesterov")
                else "_sc" if m.get("sc") else ""): m for m in SGD_MODES[1:]} | {
            k: {k: True} for k in ("wd", "maximize", "predict", "delta", "scale", "inf",
                                   "lr_tensor")} | {
            "dc": dict(dc=True, delta=True)}  # delay compensation reads delta
    singles = {k: {k: True} for k in ADAM_OFF if k not in ("decoupled", "lerp_small", "dc")}
    singles["dc"] = dict(dc=True, delta=True)
    singles["adamw"] = dict(wd=True, decoupled=True)
    singles["lerp_large"] = dict(lerp_small=False)
    singles["lr_tensor"] = dict(lr_tensor=True, device_step=True)  # (the host path reads it)
    return singles


def default_cases() -> dict[str, dict]:
    cases = {}
    for family, on in (("sgd", SGD_ON), ("adam", ADAM_ON)):
        for dtype, grad in itertools.product(DTYPES, DTYPES):
            cases[f"{family}_{dtype}_{grad}_off"] = _case(family, dtype, grad)
            cases[f"{family}_{dtype}_{grad}_on"] = _case(family, dtype, grad, **on)
        for dtype in ("float32", "bfloat16"):
            for name, opts in _singles(family).items():
                cases[f"{family}_{dtype}_{name}"] = _case(family, dtype, **opts)
            # the specializations off the arena path
            cases[f"{family}_{dtype}_on_n_odd"] = _case(family, dtype, n=N_ODD, **on)
            cases[f"{family}_{dtype}_on_unaligned"] = _case(family, dtype, n=N_ODD,
                                                            odd=["all"], **on)
            cases[f"{family}_{dtype}_on_i64"] = _case(family, dtype, n=N_I64, **on)
            cases[f"{family}_{dtype}_on_n1"] = _case(family, dtype, n=1, **on)
        cases[f"{family}_float32_on_grad_unaligned"] = _case(family, "float32", odd=["grad"],
                                                             **on)
    # momentum-free SGD's first step, Nesterov's flag without momentum, AdamW's without decay
    cases["sgd_float32_noop_flags"] = _case("sgd", "float32", init=True, nesterov=True)
    cases["adam_float32_noop_flags"] = _case("adam", "float32", decoupled=True)
    # an explicit 1024 block with bf16 beside fp32 state: the layout conversion the default
    # block avoids, compiled so the test shows its shared-memory detector fires
    cases["adam_bfloat16_off_block1024"] = _case("adam", "bfloat16", block=1024)
    for dtype, grad in itertools.product(DTYPES, DTYPES):
        cases[f"nadam_{dtype}_{grad}_off"] = _case("nadam", dtype, grad)
        cases[f"nadam_{dtype}_{grad}_on"] = _case("nadam", dtype, grad, **NADAM_ON)
    for name in ("device_step", "inf", "last", "lerp_small"):  # the host path, alone
        cases[f"nadam_float32_host_{name}"] = _case("nadam", "float32",
                                                    **{**NADAM_ON, name: False})
    # state_dtype="param" (issue 22): moments in the 16-bit param dtype, rounded on store;
    # all-16-bit sweeps (128-bit accesses) and beside fp32 delta / last_update
    for dtype in ("bfloat16", "float16"):
        for family, on, alone in (("sgd", SGD_ON, dict(momentum=True)),
                                  ("adam", ADAM_ON, dict(amsgrad=True))):
            cases[f"{family}_{dtype}_lowstate_off"] = _case(family, dtype, low_state=True)
            cases[f"{family}_{dtype}_lowstate_alone"] = _case(family, dtype, low_state=True, **alone)
            cases[f"{family}_{dtype}_lowstate_on"] = _case(family, dtype, low_state=True, **on)
    cases["nadam_float32_on_n_odd"] = _case("nadam", "float32", n=N_ODD, **NADAM_ON)
    cases["nadam_bfloat16_on_unaligned"] = _case("nadam", "bfloat16", n=N_ODD, odd=["all"],
                                                 **NADAM_ON)
    return cases | multi_default_cases()


def sweep_cases() -> dict[str, dict]:
    cases = default_cases()
    for dtype in DTYPES:
        for mode, rest in itertools.product(
                SGD_MODES, itertools.product((False, True), repeat=6)):
            opts = dict(mode, **dict(zip(("wd", "maximize", "predict", "delta", "scale", "inf"),
                                         rest, strict=True)))
            key = "_".join(k for k, v in sorted(opts.items()) if v) or "off"
            cases[f"sweep_sgd_{dtype}_{key}"] = _case("sgd", dtype, **opts)
        for i, traffic in enumerate(itertools.product((False, True), repeat=len(ADAM_TRAFFIC))):
            opts = dict(ADAM_ARITH[(7 * i) % len(ADAM_ARITH)],
                        **dict(zip(ADAM_TRAFFIC, traffic, strict=True)))
            key = "_".join(k for k, v in sorted(opts.items()) if v) or "off"
            cases[f"sweep_adam_{dtype}_{key}"] = _case("adam", dtype, **opts)
    for family in ("sgd", "adam"):
        for dtype, grad in itertools.permutations(DTYPES, 2):
            for name, opts in _singles(family).items():
                cases[f"sweep_{family}_{dtype}_{grad}_{name}"] = _case(family, dtype, grad,
                                                                       **opts)
        for dtype in ("float16",):
            on = SGD_ON if family == "sgd" else ADAM_ON
            for tag, n, odd in (("n_odd", N_ODD, ()), ("unaligned", N_ODD, ["all"]),
                                ("i64", N_I64, ()), ("n1", 1, ())):
                cases[f"sweep_{family}_{dtype}_on_{tag}"] = _case(family, dtype, n=n, odd=odd,
                                                                  **on)
    return cases | multi_sweep_cases()


_SCRIPT = r"""
import json, re, sys, traceback
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
import engine.triton_kernels.adam as adam_mod
import engine.triton_kernels.adaptive as adaptive_mod
import engine.triton_kernels.nadam as nadam_mod
import engine.triton_kernels.sgd as sgd_mod
from engine.triton_kernels.multi import SegmentTable

cases = json.load(open(sys.argv[1]))
shard, shards, out_path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
launched = []


class Capture:
    # stands in for the kernel: does what JITFunction.run does up to the compile
    def __init__(self, fn):
        self.fn = fn
        self.binder = create_function_from_signature(fn.signature, fn.params, backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs["debug"] = kwargs.get("debug", self.fn.debug) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound, spec, opts = self.binder(*args, **kwargs)
            launched.append((self.fn,) + self.fn._pack_args(backend, kwargs, bound, spec, opts))
        return launch


# the kernels where their launchers read them (Adam and NAdam: one launcher module)
adaptive_mod._advance_steps = lambda steps, found_inf: None  # a device op beside the kernel
adaptive_mod._advance_mu = lambda *args: None
for mod, name in ((sgd_mod, "_sgd_kernel"), (sgd_mod, "_sgd_multi_kernel"),
                  (adaptive_mod, "_adam_kernel"), (adaptive_mod, "_adam_multi_kernel"),
                  (adaptive_mod, "_nadam_kernel"), (adaptive_mod, "_nadam_multi_kernel")):
    setattr(mod, name, Capture(getattr(mod, name)))
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor(role, dtype, n, odd):
    if role in odd or "all" in odd:  # one element in: not 16-byte aligned
        return torch.empty(n + 1, dtype=dtype, device="meta")[1:]
    return torch.empty(n, dtype=dtype, device="meta")


def launch_multi(case):
    # two segments of meta tensors: pointers are their (offset) addresses, so an "odd" view
    # is unaligned; sizes n and n + 1024 keep n's divisibility
    o, n, odd = case["opts"], case["n"], case["odd"]
    p, st = DT[case["dtype"]], torch.float32
    ms = p if case.get("low_state") else st  # the moments' dtype
    sizes = (n, n + 1024)
    t = lambda role, dtype, on=True: [tensor(role, dtype, k, odd) for k in sizes] if on else None
    one = lambda on: torch.ones(1, device="meta") if on else None
    scalars = lambda v: [torch.full((), v, device="meta") for _ in sizes]
    rows = dict(param=t("param", p), grad=t("grad", DT[case["grad"]]), pred=t("pred", p, o["predict"]),
                delta=t("delta", st, o["delta"]))
    common = dict(predicted=rows["pred"], delta=rows["delta"], dc_coeff=0.5 if o["dc"] else 0.0,
                  grad_scale=one(o["scale"]), found_inf=one(o["inf"]), validate=False)
    lr = lambda v: torch.full((), v, device="meta") if o["lr_tensor"] else v
    if case["family"] == "sgd":
        rows["buf"] = t("buf", ms, o["momentum"])
        table = SegmentTable(sgd_mod.SGD_ROLES, rows)
        sgd_mod.launch_sgd(
            table, None, None, lr=lr(0.1), momentum=0.9 if o["momentum"] else 0.0, dampening=0.0,
            weight_decay=0.01 if o["wd"] else 0.0, nesterov=o["nesterov"],
            maximize=o["maximize"], init_momentum=o["init"], sc_delay=2 if o["sc"] else 0,
            predict_coeff=lr(0.2), delta_gamma=0.5, **common)
        return
    rows.update(m=t("m", ms), v=t("v", ms), last=t("last", st, o["last"]), step=scalars(1.0))
    kw = dict(lr=lr(1e-3), beta1=0.9 if o["lerp_small"] else 0.3, beta2=0.999, eps=1e-8,
              weight_decay=0.01 if o["wd"] else 0.0, decoupled=o["decoupled"],
              maximize=o["maximize"], last_update=rows["last"], predict_horizon=2.0,
              delta_gamma=0.5, step=rows["step"], **common)
    if case["family"] == "nadam":
        rows["prod"] = scalars(0.5)
        table = SegmentTable(nadam_mod.NADAM_ROLES, rows, scalar_roles=("step", "prod"))
        adaptive_mod.launch_nadam(table, None, None, None, None, momentum_decay=4e-3, **kw)
    else:
        rows["vmax"] = t("vmax", ms, o["amsgrad"])
        table = SegmentTable(adam_mod.ADAM_ROLES, rows, scalar_roles=("step",))
        adaptive_mod.launch_adam(table, None, None, None, None, amsgrad=o["amsgrad"],
                                 sc_delay=2 if o["sc"] else 0, **kw)


def launch(case):
    if case.get("multi"):
        return launch_multi(case)
    o, n, odd = case["opts"], case["n"], case["odd"]
    p, st = DT[case["dtype"]], torch.float32
    ms = p if case.get("low_state") else st  # the moments' dtype
    t = lambda role, dtype, on=True: tensor(role, dtype, n, odd) if on else None
    one = lambda on: torch.ones(1, device="meta") if on else None
    common = dict(predicted=t("pred", p, o["predict"]), delta=t("delta", st, o["delta"]),
                  dc_coeff=0.5 if o["dc"] else 0.0, grad_scale=one(o["scale"]), found_inf=one(o["inf"]), block=case["block"])
    # a device lr (meta: its pointer); the host path (a CPU step) would read it: a number there
    lr = lambda v: (torch.full((), v, device="meta")
                    if o["lr_tensor"] and (case["family"] == "sgd" or o["device_step"]) else v)
    if case["family"] == "sgd":
        sgd_mod.launch_sgd(
            t("param", p), t("grad", DT[case["grad"]]), t("buf", ms, o["momentum"]),
            lr=lr(0.1), momentum=0.9 if o["momentum"] else 0.0, dampening=0.0,
            weight_decay=0.01 if o["wd"] else 0.0, nesterov=o["nesterov"],
            maximize=o["maximize"], init_momentum=o["init"], sc_delay=2 if o["sc"] else 0,
            predict_coeff=lr(0.2), delta_gamma=0.5, **common)
    elif case["family"] == "nadam":
        # step and mu_product beside the params: the kernel derives the coefficients; on the
        # CPU: the host (a real CPU tensor, it is read)
        dev = "meta" if o["device_step"] else "cpu"
        adaptive_mod.launch_nadam(
            t("param", p), t("grad", DT[case["grad"]]), t("m", st), t("v", st),
            torch.full((), 0.5, device=dev), step=torch.ones((), device=dev), lr=lr(1e-3),
            beta1=0.9 if o["lerp_small"] else 0.3, beta2=0.999, eps=1e-8,
            weight_decay=0.01 if o["wd"] else 0.0, momentum_decay=4e-3,
            decoupled=o["decoupled"], maximize=o["maximize"],
            last_update=t("last", st, o["last"]), predict_horizon=2.0, delta_gamma=0.5,
            # the host path reads found_inf on the host: a meta tensor cannot be read
            **dict(common, found_inf=one(o["inf"] and o["device_step"])))
    else:
        # step beside the params: the kernel derives the bias corrections; on the CPU: the host
        step = torch.ones(1, device="meta" if o["device_step"] else "cpu")
        adaptive_mod.launch_adam(
            t("param", p), t("grad", DT[case["grad"]]), t("m", ms), t("v", ms),
            t("vmax", ms, o["amsgrad"]), step=step, lr=lr(1e-3),
            beta1=0.9 if o["lerp_small"] else 0.3, beta2=0.999, eps=1e-8,
            weight_decay=0.01 if o["wd"] else 0.0, decoupled=o["decoupled"],
            amsgrad=o["amsgrad"], maximize=o["maximize"], sc_delay=2 if o["sc"] else 0,
            last_update=t("last", st, o["last"]), predict_horizon=2.0, delta_gamma=0.5,
            **common)


def widths(ptx, op):
    out = {}
    for m in re.finditer(r"\b" + op + r"\.global((?:\.[\w:]+)+)", ptx):
        parts = m.group(1).split(".")
        vec = next((int(x[1:]) for x in parts if re.fullmatch(r"v\d", x)), 1)
        bits = int(re.search(r"\d+$", parts[-1]).group())
        out[str(vec * bits)] = out.get(str(vec * bits), 0) + 1
    return out


variants, case_variant, errors = {}, {}, {}
for name, case in cases.items():
    launched.clear()
    try:
        launch(case)
        assert len(launched) == 1, f"{len(launched)} launches"
    except Exception:
        errors[name] = traceback.format_exc()[-3000:]
        continue
    fn, options, signature, constexprs, attrs = launched[0]
    key = repr((fn.__name__, sorted(signature.items()), sorted(constexprs.items()),
                sorted(attrs.items()), sorted(options.__dict__.items())))
    case_variant[name] = variants.setdefault(key, (len(variants), launched[0]))[0]

results = {}
for key, (index, (fn, options, signature, constexprs, attrs)) in variants.items():
    if index % shards != shard:
        continue
    hinted = sorted(fn.arg_names[k[0]] for k, v in attrs.items() if ["tt.divisibility", 16] in v)
    rec = {"kernel": fn.__name__, "num_warps": options.num_warps, "hinted": hinted,
           "signature": {k: v for k, v in signature.items() if v != "constexpr"},
           # dtype constexprs (the multi-tensor kernels' operand types) as their names
           "constexprs": {fn.arg_names[k[0]]: v if isinstance(v, (bool, int, float)) else str(v)
                          for k, v in constexprs.items()}}
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                           options=options.__dict__)
        ptx = k.asm["ptx"]
        rec.update(ok=True, cubin_bytes=len(k.asm["cubin"]),
                   approx=len(re.findall(r"\b(?:div|sqrt|rcp|rsqrt)\.(?:approx|full)", ptx)),
                   rn_div=ptx.count("div.rn.f32"), rn_sqrt=ptx.count("sqrt.rn.f32"),
                   fma=ptx.count("fma.rn.f32"), loads=widths(ptx, "ld"), stores=widths(ptx, "st"),
                   shared=len(re.findall(r"\b(?:ld|st)\.shared|\bbar\.sync|\bbarrier\.sync", ptx)),
                   convert_layout=k.asm["ttgir"].count("ttg.convert_layout"))
    except Exception:
        rec.update(ok=False, error=traceback.format_exc()[-3000:])
    results[index] = rec
json.dump({"cases": case_variant, "errors": errors, "variants": results}, open(out_path, "w"))
"""

_PROBE = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def probe(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)

k = triton.compile(ASTSource(fn=probe, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"},
                             constexprs={"BLOCK": 128}), target=GPUTarget("cuda", 90, 32))
assert k.asm["cubin"]
"""


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")  # really compile, and leave no trace
    env["CUDA_VISIBLE_DEVICES"] = ""  # what a CPU machine sees, also on a GPU host
    return env


def _script(tmp: Path, name: str, code: str) -> Path:
    # @triton.jit needs its source in a file (it reads it with inspect), so no ``python -c``
    path = tmp / name
    path.write_text(code)
    return path


@pytest.fixture(scope="module", params=["default", pytest.param("sweep", marks=pytest.mark.slow)])
def compiled(request, tmp_path_factory):
    if request.param == "sweep" and os.environ.get("PE_AOT_SWEEP") != "1":
        pytest.skip("the 2,130-case sweep (~5 CPU-min) runs with PE_AOT_SWEEP=1, as .ci/run does "
                    "after the default suite; the default set covers every flag and dtype pair")
    tmp = tmp_path_factory.mktemp(f"aot_{request.param}")
    env = _env(tmp)
    # can this machine compile Triton for sm_90 at all? (bundled ptxas, CUDA backend)
    probe = subprocess.run([sys.executable, str(_script(tmp, "probe.py", _PROBE))], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip("Triton cannot compile for sm_90 on this machine (no CUDA backend or "
                    f"ptxas): {last[:300]}")
    cases = default_cases() if request.param == "default" else sweep_cases()
    (tmp / "cases.json").write_text(json.dumps(cases))
    script = _script(tmp, "aot.py", _SCRIPT)
    # one compiling process per core (ptxas and the MLIR passes are single-threaded)
    shards = max(1, min(8, len(os.sched_getaffinity(0))))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp / "cases.json"), str(i),
                               str(shards), str(tmp / f"out{i}.json")], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(shards)]
    merged: dict = {"variants": {}}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=3000)
        assert proc.returncode == 0, f"AOT shard {i} failed:\n{out[-2000:]}\n{err[-4000:]}"
        part = json.loads((tmp / f"out{i}.json").read_text())
        merged["cases"], merged["errors"] = part["cases"], part["errors"]
        merged["variants"].update(part["variants"])
    merged["set"], merged["specs"] = request.param, cases
    return merged


def _variant(compiled, name):
    return compiled["variants"][str(compiled["cases"][name])]


def _on_default_block(spec) -> bool:
    return spec["block"] is None


def test_every_case_launches_and_compiles_for_sm90(compiled):
    assert not compiled["errors"], f"launchers refused cases: {compiled['errors']}"
    assert set(compiled["cases"]) == set(compiled["specs"])
    failed = {k: v["error"] for k, v in compiled["variants"].items() if not v["ok"]}
    assert not failed, "\n\n".join(f"variant {k}:\n{e}" for k, e in failed.items())
    assert all(v["cubin_bytes"] > 0 for v in compiled["variants"].values())
    print(f"\n{compiled['set']}: {len(compiled['cases'])} cases, "
          f"{len(compiled['variants'])} distinct variants compiled for sm_90")


def test_multi_tensor_variants_specialized_as_a_gpu_launch(compiled):
    """The multi-tensor kernels: operand dtypes are constexprs, the tables are aligned
    arguments, and ALIGNED (the in-kernel hints) holds exactly where every pointer is 16-byte
    aligned and every size a multiple of 16."""
    checked = 0
    for name, spec in compiled["specs"].items():
        if not spec["multi"]:
            continue
        v = _variant(compiled, name)
        c = v["constexprs"]
        assert v["kernel"] == f"_{spec['family']}_multi_kernel", name
        assert c["ALIGNED"] == (not spec["odd"] and spec["n"] % 16 == 0), (name, c["ALIGNED"])
        tl_name = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        assert (c["PARAM_T"], c["GRAD_T"]) == (tl_name[spec["dtype"]], tl_name[spec["grad"]]), c
        assert {"meta_ptr", "chunk_ptr"} <= set(v["hinted"]), name
        assert v["num_warps"] == 4, name
        checked += 1
    assert checked >= 5


def test_specialized_as_a_gpu_launch(compiled):
    for name, spec in compiled["specs"].items():
        if spec["multi"]:
            continue  # test_multi_tensor_variants_specialized_as_a_gpu_launch
        v = _variant(compiled, name)
        sig, o, hinted = v["signature"], spec["opts"], set(v["hinted"])
        p, g = (f"*{ {'float32': 'fp32', 'bfloat16': 'bf16', 'float16': 'fp16'}[spec[k]] }"
                for k in ("dtype", "grad"))
        assert sig["param_ptr"] == p and sig["grad_ptr"] == g, (name, sig)
        # an optional tensor that is off is replaced by the param: its pointer has that dtype
        opt_ptrs = {"pred_ptr": o["predict"], "delta_ptr": o["delta"], "scale_ptr": o["scale"],
                    "inf_ptr": o["inf"]}
        if spec["family"] == "sgd":
            opt_ptrs["buf_ptr"] = o["momentum"]
        elif spec["family"] == "nadam":
            # found_inf reaches the kernel on the device path only (the host reads it)
            opt_ptrs |= {"last_ptr": o["last"], "step_ptr": o["device_step"],
                         "prod_ptr": o["device_step"], "inf_ptr": o["inf"] and o["device_step"]}
        else:
            opt_ptrs |= {"vmax_ptr": o["amsgrad"], "last_ptr": o["last"],
                         "step_ptr": o["device_step"]}
        lr_on, derived = _device_lr(spec)
        opt_ptrs |= {"lr_ptr": lr_on, "aux_ptr": derived}
        for ptr, on in opt_ptrs.items():
            moment = ptr in ("buf_ptr", "vmax_ptr") and spec.get("low_state")
            want = p if not on or ptr == "pred_ptr" or moment else "*fp32"
            assert sig[ptr] == want, (name, ptr, sig[ptr], want)
        ptrs = {a for a in sig if a.endswith("_ptr")}
        if spec["n"] == 1:
            assert "n" not in sig and v["constexprs"]["n"] == 1, name  # Triton's n == 1 rule
        else:
            assert sig["n"] == ("i64" if spec["n"] >= 2**31 else "i32"), (name, sig["n"])
            assert ("n" in hinted) == (spec["n"] % 16 == 0), (name, hinted)
        if not spec["odd"]:
            assert ptrs <= hinted, (name, ptrs - hinted)
        elif spec["odd"] == ["all"]:
            # placeholders are the (unaligned) param; the one-element tensors stay aligned
            scalars = {"scale_ptr", "inf_ptr"} | (
                {"step_ptr", "prod_ptr"} if o.get("device_step") else set()) | (
                {"lr_ptr"} if lr_on else set()) | ({"aux_ptr"} if derived else set())
            assert not hinted & (ptrs - scalars), (name, hinted)
        else:
            assert not hinted & {f"{r}_ptr" for r in spec["odd"]}, (name, hinted)
            assert "param_ptr" in hinted, name
        assert v["num_warps"] == 4, name
    # flags that change no code make no second variant
    for family in ("sgd", "adam"):
        cases = compiled["cases"]
        assert cases[f"{family}_float32_noop_flags"] == cases[f"{family}_float32_float32_off"]


def test_ieee_division_and_square_root_only(compiled):
    for name, spec in compiled["specs"].items():
        v = _variant(compiled, name)
        assert v["approx"] == 0, (name, "approximate div/sqrt/rcp in the PTX")
        if spec["family"] in ("adam", "nadam"):
            assert v["rn_div"] > 0 and v["rn_sqrt"] > 0, name


def _device_lr(spec) -> tuple[bool, bool]:
    """Whether the kernel loads a device lr, and the scalar derived from it (SGD: the
    prediction coefficient; Adam/NAdam: the decoupled decay); the host path (a CPU step)
    takes a number."""
    o = spec["opts"]
    on = bool(o.get("lr_tensor")) and (spec["family"] == "sgd" or bool(o["device_step"]))
    derived = o["predict"] if spec["family"] == "sgd" else o["wd"] and o["decoupled"]
    return on, on and bool(derived)


def _expected_accesses(spec) -> tuple[Counter, Counter]:
    """Vector widths (bits) of the global loads and stores one thread issues on the arena path."""
    o = spec["opts"]
    if spec["family"] == "sgd":
        loads = ["param", "grad"] + ["buf"] * (o["momentum"] and not o["init"])
        stores = ["param"] + ["buf"] * o["momentum"] + ["pred"] * o["predict"]
    else:
        vmax = o.get("amsgrad", False)
        loads = ["param", "grad", "m", "v"] + ["vmax"] * vmax
        stores = ["param", "m", "v"] + ["vmax"] * vmax + ["last"] * o["last"]
        stores += ["pred"] * o["predict"]
    loads += ["delta"] * o["delta"]
    stores += ["delta"] * o["delta"]

    def dtype(role):  # the state is fp32; the moments the param's under low_state
        if spec.get("low_state") and role in ("buf", "m", "v", "vmax"):
            return spec["dtype"]
        return {"param": spec["dtype"], "pred": spec["dtype"], "grad": spec["grad"]}.get(
            role, "float32")

    swept = {BITS[dtype(r)] for r in loads + stores}
    per_thread = 4 if len(swept) > 1 else 8  # triton_kernels/_launch.py: BLOCK 512 or 1024

    def widths(roles):
        out = Counter()
        for r in roles:
            bits = per_thread * BITS[dtype(r)]
            out[min(bits, 128)] += max(1, bits // 128)
        return out

    scalars = sum(bool(o.get(k)) for k in SCALAR_FLAGS) + sum(_device_lr(spec))
    if spec["family"] == "nadam" and o["device_step"]:
        scalars += 1  # mu_product beside the step
    if spec["family"] == "nadam" and o["inf"] and not o["device_step"]:
        scalars -= 1  # the host read found_inf
    scalar = Counter({32: scalars})
    if spec["multi"]:
        # the tables: segment index, chunk start, size, and one data pointer per operand in use
        rows = set(loads) | set(stores) | ({"step"} if o.get("device_step") else set())
        rows |= {"prod"} if spec["family"] == "nadam" and o["device_step"] else set()
        scalar[64] += 3 + len(rows)
    return widths(loads) + scalar, widths(stores)


def test_arena_path_is_vectorized(compiled):
    """Aligned pointers, n a multiple of 16: fp32 in 128-bit accesses; bf16/fp16 in 128-bit
    ones, or 64-bit beside fp32 (one shared layout, no exchange between threads). The same
    for an aligned multi-tensor launch (ALIGNED: its hints give the same accesses), whose
    unaligned launch is scalar."""
    checked = multi = 0
    for name, spec in compiled["specs"].items():
        if spec["odd"] or spec["n"] % 16 or not _on_default_block(spec):
            continue
        v = _variant(compiled, name)
        loads, stores = _expected_accesses(spec)
        got_loads = Counter({int(k): c for k, c in v["loads"].items()})
        got_stores = Counter({int(k): c for k, c in v["stores"].items()})
        assert (got_loads, got_stores) == (loads, stores), (name, "loads/stores (bits: count)",
                                                            got_loads, got_stores, "expected",
                                                            loads, stores)
        if spec["dtype"] == spec["grad"] == "float32":
            assert set(got_stores) == {128}, name
        checked += 1
        multi += spec["multi"]
    assert checked >= 50 and multi >= 4
    v = _variant(compiled, "multi_adam_float32_on_unaligned")
    assert set(v["loads"]) <= {"32", "64"} and set(v["stores"]) == {"32"}


def test_no_shared_memory_round_trip(compiled):
    """No variant a launcher picks converts layouts through shared memory (a barrier per block)."""
    for name, spec in compiled["specs"].items():
        v = _variant(compiled, name)
        if _on_default_block(spec):
            assert v["shared"] == 0 and v["convert_layout"] == 0, (name, v["shared"])
    # the detector works: bf16 beside fp32 state at 8 elements per thread converts
    v = _variant(compiled, "adam_bfloat16_off_block1024")
    assert v["shared"] > 0 and v["convert_layout"] > 0
