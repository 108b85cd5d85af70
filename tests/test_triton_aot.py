"""Ahead-of-time compilation of the optimizer kernels for sm_90, without a GPU.

The interpreter runs kernel bodies as numpy code, so it misses whatever only the real
compiler sees: type errors in constexpr branches, unsupported ops (fp64 exp for Adam's
in-kernel bias correction), layout problems. ``triton.compile`` for a CUDA target needs no
GPU, only the bundled ptxas, so every main flag combination is compiled here to PTX and a
cubin. It must run in a process where TRITON_INTERPRET is unset (the conftest sets it for
this one), hence the subprocess. The PTX is also checked for the IEEE-rounded division and
square root that make GPU results agree with the reference (plain ``/`` and ``sqrt`` would
compile to approximate instructions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# name -> (kernel, pointer dtypes that differ from fp32, n's type, constexpr flags)
SGD_OFF = dict(WEIGHT_DECAY=False, MOMENTUM=False, INIT=False, NESTEROV=False, SC=False,
               MAXIMIZE=False, PREDICT=False, DELTA=False, SCALE=False, CHECK_INF=False)
ADAM_OFF = dict(WEIGHT_DECAY=False, DECOUPLED=False, AMSGRAD=False, MAXIMIZE=False, SC=False,
                LAST=False, PREDICT=False, DELTA=False, SCALE=False, CHECK_INF=False,
                DEVICE_STEP=False, LERP_SMALL=True)
LOW = {"param_ptr", "grad_ptr", "pred_ptr"}  # the tensors that take the param's dtype
COMBOS = {
    "sgd_fp32_plain": ("sgd", "fp32", "i32", dict(SGD_OFF)),
    "sgd_fp32_momentum_init": ("sgd", "fp32", "i32", dict(SGD_OFF, MOMENTUM=True, INIT=True)),
    "sgd_fp32_nesterov_wd_i64": ("sgd", "fp32", "i64",
                                 dict(SGD_OFF, MOMENTUM=True, NESTEROV=True, WEIGHT_DECAY=True)),
    "sgd_bf16_all": ("sgd", "bf16", "i32", dict(
        {k: True for k in SGD_OFF}, INIT=False, NESTEROV=False)),
    "sgd_fp16_sc_pred": ("sgd", "fp16", "i32",
                         dict(SGD_OFF, MOMENTUM=True, SC=True, PREDICT=True, MAXIMIZE=True)),
    "adam_fp32_plain_host": ("adam", "fp32", "i32", dict(ADAM_OFF)),
    "adam_fp32_device_step": ("adam", "fp32", "i32", dict(ADAM_OFF, DEVICE_STEP=True,
                                                          WEIGHT_DECAY=True)),
    "adamw_bf16_all": ("adam", "bf16", "i32", dict(
        {k: True for k in ADAM_OFF}, LERP_SMALL=True)),
    "adam_fp16_amsgrad_sc_host": ("adam", "fp16", "i64", dict(
        ADAM_OFF, AMSGRAD=True, SC=True, SCALE=True, CHECK_INF=True, LERP_SMALL=False)),
    # Triton's JIT turns an int argument equal to 1 into a constant: a one-element tensor
    # compiles with n as a constexpr, which CHECK_INF then rebinds
    "sgd_n1_constexpr": ("sgd", "fp32", "i32", dict(
        {k: True for k in SGD_OFF}, INIT=False, n=1)),
    "adam_n1_constexpr": ("adam", "bf16", "i32", dict(
        {k: True for k in ADAM_OFF}, n=1)),
}

_SCRIPT = r"""
import json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_kernels.adam import adam_kernel
from triton_kernels.sgd import sgd_kernel

combos = json.loads(sys.argv[1])
low = set(json.loads(sys.argv[2]))
kernels = {"sgd": sgd_kernel, "adam": adam_kernel}
target = GPUTarget("cuda", 90, 32)
out = {}
for name, (kname, dtype, ntype, flags) in combos.items():
    fn = kernels[kname]
    sig = {}
    for arg in fn.arg_names:
        if arg in flags or arg == "BLOCK":
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = "*" + (dtype if arg in low else "fp32")
        elif arg == "n":
            sig[arg] = ntype
        else:
            sig[arg] = "fp32"
    missing = [a for a in fn.arg_names if a.isupper() and a != "BLOCK" and a not in flags]
    if missing:
        out[name] = {"ok": False, "error": f"flags not given: {missing}"}
        continue
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(flags, BLOCK=1024)),
                           target=target, options={"num_warps": 4})
        ptx = k.asm["ptx"]
        out[name] = {"ok": True, "cubin_bytes": len(k.asm["cubin"]),
                     "approx_div": ptx.count("div.approx") + ptx.count("div.full"),
                     "approx_sqrt": ptx.count("sqrt.approx"),
                     "rn_div": ptx.count("div.rn"), "rn_sqrt": ptx.count("sqrt.rn")}
    except Exception:
        out[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
print("AOT-RESULT " + json.dumps(out))
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


def _run(tmp: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    # @triton.jit needs its source in a file (it reads it with inspect), so no ``python -c``
    script = tmp / f"aot_{abs(hash(code))}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    # can this machine compile Triton for sm_90 at all? (bundled ptxas, CUDA backend)
    probe = _run(tmp, _PROBE)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip("Triton cannot compile for sm_90 on this machine (no CUDA backend or "
                    f"ptxas): {last[:300]}")
    proc = _run(tmp, _SCRIPT, json.dumps(COMBOS), json.dumps(sorted(LOW)))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AOT-RESULT ")]
    assert lines, f"AOT script failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("AOT-RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBOS))
def test_kernel_compiles_for_sm90(compiled, name):
    result = compiled[name]
    assert result["ok"], result.get("error")
    assert result["cubin_bytes"] > 0
    # IEEE division/sqrt only: approximate ones would break agreement with the reference
    assert result["approx_div"] == 0
    assert result["approx_sqrt"] == 0
    if COMBOS[name][0] == "adam":
        assert result["rn_sqrt"] > 0 and result["rn_div"] > 0
