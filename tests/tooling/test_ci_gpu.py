"""`.ci/gpu OUTDIR PHASE`, checked on CPU: it parses, refuses bad usage, and its dry run
(PE_GPU_DRY_RUN=1) lists each phase's commands, all naming files and options that exist.

The script itself only runs on a lent GPU machine, one phase per (10-minute) command, so a
typo found there costs a GPU session; these checks find it in CPU CI.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "gpu"
PHASES = ["build", "test", "test-optim", "bench-kernels", "bench-pipeline", "bench-capture",
          "bench-lm", "nccl"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args: str, dry: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **env)
    full.pop("PE_GPU_DRY_RUN", None)
    if dry:
        full["PE_GPU_DRY_RUN"] = "1"
    full.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # skips the GPU probe (a torch import)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=120)


def steps(out: str) -> dict[str, list[str]]:
    """'[dry-run] PHASE/NAME (budget Ns): CMD' -> {'PHASE/NAME': argv}."""
    found = {}
    for m in re.finditer(r"^\[dry-run\] (\S+) \(budget (\d+)s\): (.*)$", out, re.M):
        found[m.group(1)] = shlex.split(m.group(3))
    return found


def budgets(out: str) -> dict[str, int]:
    """'[dry-run] PHASE/NAME (budget Ns): CMD' -> {'PHASE/NAME': N}."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^\[dry-run\] (\S+) \(budget (\d+)s\): ", out, re.M)}


def test_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args", [(), ("OUT",), ("OUT", "bench"), ("OUT", "test", "extra")],
                         ids=["none", "no-phase", "unknown-phase", "extra-arg"])
def test_usage_errors_exit_2_with_the_usage_and_write_nothing(args, tmp_path: Path) -> None:
    args = tuple(str(tmp_path / "o") if a == "OUT" else a for a in args)
    proc = run(*args, dry=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage: bash .ci/gpu OUTDIR PHASE" in proc.stderr
    for phase in [*PHASES, "all"]:
        assert phase in proc.stderr
    if "bench" in args:
        assert "unknown phase 'bench'" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_each_phase_lists_its_commands_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "o"
    listed = {}
    for phase in PHASES:
        proc = run(str(out), phase)
        assert proc.returncode == 0, proc.stderr
        listed[phase] = steps(proc.stdout)
        assert listed[phase], proc.stdout
        assert all(name.startswith(phase + "/") for name in listed[phase]), listed[phase]
    assert not out.exists()

    build = listed["build"]
    assert list(build) == ["build/compiler", "build/install", "build/info", "build/pytest-build"]
    assert build["build/compiler"][1:] == ["engine/tooling/cxx_runtime.py", "--pick"]
    assert build["build/install"][1:] == ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", "."]
    assert build["build/info"][1:] == ["-m", "engine", "info"]
    # after the build: the arena, its bindings' error paths and the libstdc++ check
    build_files = [a for a in build["build/pytest-build"] if a.startswith("tests/")]
    assert build_files == ["tests/arena/test_arena.py", "tests/arena/test_arena_bindings.py",
                           "tests/tooling/test_build.py"]
    assert f"--junitxml={out}/build/junit-build.xml" in build["build/pytest-build"]

    test = listed["test"]
    gpu_files = build_files + [a for a in test["test/pytest-gpu"] if a.startswith("tests/")]
    gpu_files += [a for a in listed["test-optim"]["test-optim/pytest-gpu"] if a.startswith("tests/")]
    for name in ("test_kernels_sgd.py", "test_kernels_adam.py", "test_optim_fused.py",
                 "test_arena.py", "test_runtime_cuda.py"):
        assert any(f.endswith(f"/{name}") for f in gpu_files), name
    # every file that puts its tensors on the kernel device runs whole on the GPU (a file
    # missing here would only run its cuda-marked tests there, and its kernels never compiled)
    on_kernel_device = sorted(
        str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^from kernel_support import", f.read_text(), re.M)
    )
    assert set(on_kernel_device) <= set(gpu_files), set(on_kernel_device) - set(gpu_files)
    assert len(gpu_files) == len(set(gpu_files))
    marked = test["test/pytest-cuda-marked"]
    assert ("-m", "cuda") in zip(marked, marked[1:], strict=False)
    assert {f"--ignore={f}" for f in gpu_files} <= set(marked)  # nothing runs twice
    assert "--ignore=tests/runtime/ranks/test_distributed_nccl.py" in marked  # the nccl phase's file
    for argv in test.values():
        junit = [a for a in argv if a.startswith("--junitxml=")]
        assert len(junit) == 1 and junit[0].startswith(f"--junitxml={out}/test/")
        assert "--continue-on-collection-errors" in argv  # one broken file stops nothing else

    assert {k.split("/")[1] for k in listed["bench-kernels"]} == {"optim", "l2_persistence"}
    assert {k.split("/")[1] for k in listed["bench-pipeline"]} >= {"overhead", "pipeline_gloo"}
    assert set(listed["bench-capture"]) == {"bench-capture/pipeline_capture_gpu",
                                            "bench-capture/pipeline_pb_capture_gpu"}
    # both models and the rounds named explicitly (the budget was sized for them)
    capture = listed["bench-capture"]["bench-capture/pipeline_capture_gpu"]
    models = capture[capture.index("--models") + 1:]
    models = models[:next((i for i, a in enumerate(models) if a.startswith("--")), len(models))]
    assert models == ["dense", "transformer"]
    source = (ROOT / "bench" / "pipeline_capture_gpu.py").read_text()
    assert all(f'"{m}": ' in source for m in models)  # its MODELS table's keys
    assert capture[capture.index("--rounds") + 1] == "11"
    lm = listed["bench-lm"]
    assert list(lm) == ["bench-lm/lm_gpu", "bench-lm/optim", "bench-lm/host_cost"]
    opt = lm["bench-lm/optim"]
    assert opt[opt.index("--sizes") + 1] == "16MiB,1GiB"
    assert opt[opt.index("--dtypes") + 1] == "fp32,bf16"
    assert set(opt[opt.index("--kernels") + 1].split(",")) == {
        "sgd", "adam", "adamw", "sgd_bf16st", "adam_bf16st", "adamw_bf16st"}
    host = lm["bench-lm/host_cost"]
    assert host[host.index("--device") + 1] == "cuda"
    lm_gpu = lm["bench-lm/lm_gpu"]
    assert lm_gpu[lm_gpu.index("--rounds") + 1] == "11"
    assert "--compile-budget" in lm_gpu and "--quick" not in lm_gpu and "--dry-run" not in lm_gpu
    for phase in ("bench-kernels", "bench-pipeline", "bench-capture", "bench-lm"):
        for argv in listed[phase].values():
            assert argv[argv.index("--out") + 1] == f"{out}/{phase}"

    nccl = listed["nccl"]
    assert list(nccl) == ["nccl/tests-2", "nccl/tests-4", "nccl/pipeline_nccl-2",
                          "nccl/pipeline_nccl-4"]
    for r in (2, 4):
        argv = nccl[f"nccl/tests-{r}"]
        assert argv[:3] == ["env", "-u", "PYTEST_ADDOPTS"]  # no xdist workers: ranks hold GPUs
        assert argv[-1] == "tests/runtime/ranks/test_distributed_nccl.py"
        assert argv[argv.index("-k") + 1] == f"ranks{r}"
        assert f"--junitxml={out}/nccl/junit-{r}.xml" in argv
        argv = nccl[f"nccl/pipeline_nccl-{r}"]
        assert argv[argv.index("--ranks") + 1] == str(r)
        assert argv[argv.index("--out") + 1] == f"{out}/nccl"

    # each phase's step budgets add up to under 9 minutes (one command may run 10)
    for phase in PHASES:
        spent = budgets(run(str(out), phase).stdout)
        assert spent and sum(spent.values()) < 9 * 60, (phase, spent)

    # `all` is the seven phases in order
    proc = run(str(out), "all")
    assert proc.returncode == 0, proc.stderr
    assert list(steps(proc.stdout)) == [name for phase in PHASES for name in listed[phase]]


def test_a_later_command_can_skip_the_build_tests(tmp_path: Path) -> None:
    """PE_GPU_BUILD_TESTS=0 (the lease's second command): build without its test files."""
    proc = run(str(tmp_path / "o"), "build", PE_GPU_BUILD_TESTS="0")
    assert proc.returncode == 0, proc.stderr
    assert list(steps(proc.stdout)) == ["build/compiler", "build/install", "build/info"]


def _harness_option_helpers() -> dict[str, str]:
    """bench/harness.py's functions that add options to a parser, by name: their source."""
    text = (ROOT / "bench" / "harness.py").read_text()
    functions = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)]
    sources = {n.name: ast.get_source_segment(text, n) or "" for n in functions}
    return {name: src for name, src in sources.items() if "add_argument" in src}


def test_listed_files_and_options_exist(tmp_path: Path) -> None:
    """A renamed test file, bench script or option fails here, not on the GPU machine."""
    proc = run(str(tmp_path / "o"), "all")
    for name, argv in steps(proc.stdout).items():
        for arg in argv:
            if re.fullmatch(r"(tests|bench)/\S+\.py", arg):
                assert (ROOT / arg).is_file(), f"{name}: {arg} does not exist"
        script = next((a for a in argv if re.fullmatch(r"bench/\S+\.py", a)), None)
        if script:
            source = (ROOT / script).read_text()
            source += "".join(  # options a script takes from bench/harness.py's helpers
                text for helper, text in _harness_option_helpers().items() if f"{helper}(" in source
            )
            for opt in (a for a in argv[argv.index(script) + 1:] if a.startswith("--")):
                assert f'"{opt}"' in source, f"{name}: {script} has no option {opt}"


def test_cuda_environment_defaults(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST")}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "build"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=dict(env, PE_GPU_DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert "[dry-run] CUDA_HOME=/usr/local/cuda\n" in proc.stdout
    arch = re.search(r"^\[dry-run\] TORCH_CUDA_ARCH_LIST=(.*)$", proc.stdout, re.M).group(1)
    assert re.fullmatch(r"\d+\.\d+(;\d+\.\d+)*", arch), arch
    if shutil.which("nvidia-smi") is None:
        import torch

        if not torch.cuda.is_available():
            assert arch == "9.0"  # none visible: the H100 default
    # explicit settings win
    proc = run(str(tmp_path), "build", CUDA_HOME="/opt/cuda-x", TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX")
    assert "[dry-run] CUDA_HOME=/opt/cuda-x\n" in proc.stdout
    assert "[dry-run] TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX\n" in proc.stdout


LEASE = ROOT / ".ci" / "gpu-lease"


@pytest.mark.parametrize("args", [(), ("OUT", "nccl"), ("OUT", "lm", "extra")],
                         ids=["none", "unknown-mode", "extra-arg"])
def test_the_lease_script_parses_and_refuses_bad_usage(args, tmp_path: Path) -> None:
    """.ci/gpu-lease (a device lease's two commands: build, tests and the capture
    benchmarks; then `lm`, the transformer and kernel benchmarks)."""
    assert subprocess.run(["bash", "-n", str(LEASE)], capture_output=True).returncode == 0
    args = tuple(str(tmp_path / "o") if a == "OUT" else a for a in args)
    proc = subprocess.run(["bash", str(LEASE), *args], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: bash .ci/gpu-lease OUTDIR [bench|lm]" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_lease_lm_command_fits_one_device_command(tmp_path: Path) -> None:
    """The second command's worst case: a build (install measured 36-42 s on the H100, its
    tests skipped) plus bench-lm's step budgets and their kill grace, under the device tool's
    600 s per command."""
    text = LEASE.read_text()
    block = text[text.index("if [[ $MODE == lm ]]"):]
    block = block[:block.index("\nfi\n")]
    assert re.findall(r'bash \.ci/gpu "\$R" (\S+);', block) == ["bench-lm"]
    spent = budgets(run(str(tmp_path / "o"), "bench-lm").stdout)
    build = 60  # compiler probe, install, info (measured ~45 s together)
    assert build + sum(spent.values()) + 20 * len(spent) < 600, spent
    assert "PE_GPU_BUILD_TESTS=0" in text[:text.index("if [[ $MODE == lm ]]")]


def test_the_lease_runs_phases_and_benchmarks_that_exist() -> None:
    text = LEASE.read_text()
    # (the NCCL block's build and nccl phase first: several GPUs)
    assert re.findall(r'bash \.ci/gpu "\$R" (\S+);', text) == [
        "build", "nccl", "build", "bench-lm", "test", "test-optim"]
    loop = re.search(r"for b in ([\w ]+); do", text)
    assert loop is not None
    opts = re.findall(r"(--[\w-]+)", text[loop.end():text.index("done", loop.end())])
    helpers = _harness_option_helpers()
    for script in loop.group(1).split():
        source = (ROOT / "bench" / f"{script}.py").read_text()
        source += "".join(t for h, t in helpers.items() if f"{h}(" in source)
        for opt in opts:
            assert f'"{opt}"' in source, f"bench/{script}.py has no option {opt}"


@pytest.mark.parametrize("k", ["2", "4"])
def test_the_nccl_phase_selects_tests_that_exist(k: str) -> None:
    """`-k ranksN` of the nccl phase's pytest steps collects tests of that world size (a
    renamed test would otherwise select nothing, and pass, on the multi-GPU machine)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
         "-k", f"ranks{k}", "tests/runtime/ranks/test_distributed_nccl.py"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids and all(f"ranks{k}" in i for i in ids), proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks a machine without GPUs")
def test_the_nccl_phase_passes_without_two_gpus(tmp_path: Path) -> None:
    """Not a dry run: on a machine without GPUs the phase says why it is skipped, runs
    nothing and exits 0."""
    proc = run(str(tmp_path / "o"), "nccl", dry=False, PYTHONPATH=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[nccl] skipped: NCCL between processes needs >= 2 GPUs" in proc.stdout
    assert "nvidia-smi -L lists 0" in proc.stdout
    assert (tmp_path / "o" / "steps.csv").read_text().splitlines() == [
        "phase,step,exit,seconds,budget_s"]


def _lease_nccl_block() -> str:
    text = LEASE.read_text()
    start = text.index("# ---- NCCL across GPUs")
    return text[start:text.index("# ---- end of the NCCL block", start)]


@pytest.mark.parametrize("gpus,skip,runs", [(2, "", True), (4, "", True), (1, "", False),
                                            (0, "", False), (4, "0", False)])
def test_the_lease_runs_the_nccl_phase_first_and_alone_with_several_gpus(
        tmp_path: Path, gpus: int, skip: str, runs: bool) -> None:
    """The lease's NCCL block, run as it is (with .ci/gpu in dry-run mode and an nvidia-smi
    that lists ``gpus`` GPUs): with 2+ GPUs it builds without the build's test files, runs the
    nccl phase and ends the command; otherwise (or with PE_GPU_LEASE_NCCL=0) the lease goes
    on to its other commands."""
    fake = tmp_path / "bin"
    fake.mkdir()
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus))
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}exit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    script = tmp_path / "block.sh"
    script.write_text("set -uo pipefail\nR=$1\npack() { :; }\n" + _lease_nccl_block()
                      + "echo 'went on to the other phases'\n")
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", PE_GPU_DRY_RUN="1",
               TORCH_CUDA_ARCH_LIST="9.0", PE_GPU_LEASE_NCCL=skip or "1", PYTHONPATH=str(ROOT))
    env.pop("PE_GPU_BUILD_TESTS", None)
    proc = subprocess.run(["bash", str(script), str(tmp_path / "r")], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = list(steps(proc.stdout))
    if runs:
        built = [n for n in ran if n.startswith("build/")]
        assert "build/install" in built and "build/pytest-build" not in built, ran
        assert [n for n in ran if n not in built] == [
            "nccl/tests-2", "nccl/tests-4", "nccl/pipeline_nccl-2", "nccl/pipeline_nccl-4"]
        assert ran.index("build/install") < ran.index("nccl/tests-2")
        assert "went on" not in proc.stdout and "PE_GPU_LEASE_NCCL=0" in proc.stderr
    else:
        assert ran == [] and "went on to the other phases" in proc.stdout


def test_the_lease_nccl_command_fits_one_device_command(tmp_path: Path) -> None:
    """Its worst case: a build (install measured 36-42 s on the H100) plus the nccl phase's
    step budgets and their kill grace, under the device tool's 600 s per command."""
    spent = budgets(run(str(tmp_path / "o"), "nccl").stdout)
    assert len(spent) == 4
    build = 60
    assert build + sum(spent.values()) + 20 * len(spent) < 600, spent
