"""Every GPU test file draws its random tensors from a generator on their device.

tests/generator_devices.py holds the (static) check and says why; here it runs over every
test file the GPU machine runs (.ci/gpu's whole files, files with `cuda`-marked tests, files
under kernel_support's device fixture), and is shown to catch the bad samples it exists for.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from generator_devices import check_file, check_source

TESTS = Path(__file__).resolve().parent
#: the import that puts a sample under kernel_support's device fixture (kept off the start of
#: a line here: tests/tooling/test_ci_gpu.py reads such lines as this file using the fixture)
FIXTURE = "from kernel_support import DEVICE, _on_device\n"


def gpu_test_files() -> list[Path]:
    ci = (TESTS.parent / ".ci" / "gpu").read_text()
    named = {TESTS.parent / m for m in re.findall(r"tests/[\w/]*test_\w+\.py", ci)}
    marked = {p for p in TESTS.rglob("test_*.py")
              if re.search(r"mark\.cuda|\b_on_device\b|device=\"cuda\"|\"cuda\"", p.read_text())}
    return sorted(named | marked)


def test_the_gpu_file_list_covers_the_known_ones() -> None:
    names = {p.name for p in gpu_test_files()}
    assert {"test_optim_multi.py", "test_kernels_sgd.py", "test_runtime_device_flags.py",
            "test_arena.py", "test_runtime_l2.py"} <= names


@pytest.mark.parametrize("path", gpu_test_files(), ids=lambda p: p.name)
def test_gpu_test_file_draws_on_its_generators_device(path: Path) -> None:
    problems = check_file(path)
    assert not problems, "\n".join(problems)


BAD = {
    # the H100 failure: a CPU generator, no device=, under the device fixture
    "factory_under_fixture": (FIXTURE + """
def _t(n, gen):
    return torch.randn(n, generator=gen).to(DEVICE)
def test_x():
    gen = torch.Generator().manual_seed(0)
    _t(3, gen)
""", True),
    "explicit_cuda_from_cpu_generator": ("""
def test_x():
    g = torch.Generator(device="cpu")
    torch.rand(3, device="cuda", generator=g)
""", False),
    "cuda_generator_cpu_draw": ("""
def test_x():
    g = torch.Generator(device="cuda").manual_seed(1)
    torch.randn(4, generator=g)
""", False),
    "inline_generator": ("""
def test_x():
    torch.randn(4, device=DEVICE, generator=torch.Generator().manual_seed(1))
""", False),
    "fill_under_fixture": (FIXTURE + """
def test_x():
    g = torch.Generator()
    torch.empty(5).normal_(generator=g)
""", True),
    "fill_of_explicit_device": ("""
def test_x():
    g = torch.Generator()
    torch.empty(5, device="cuda").uniform_(generator=g)
""", False),
}

GOOD = {
    "cpu_draw_then_move": (FIXTURE + """
def test_x():
    gen = torch.Generator().manual_seed(0)
    torch.randn(3, generator=gen, device="cpu").to(DEVICE)
""", True),
    "matching_cuda": ("""
def test_x():
    g = torch.Generator(device="cuda").manual_seed(1)
    torch.randn(4, device="cuda", generator=g)
""", False),
    "cpu_file_without_fixture": ("""
def test_x():
    g = torch.Generator().manual_seed(1)
    torch.randn(4, generator=g)
    torch.empty(4).normal_(generator=g)
""", False),
    "device_object_spelling": ("""
def test_x():
    g = torch.Generator(torch.device("cpu"))
    torch.randn(4, device=torch.device('cpu'), generator=g)
""", True),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_check_catches(name: str) -> None:
    source, fixture = BAD[name]
    assert check_source(source, default_device=fixture), name


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_check_accepts(name: str) -> None:
    source, fixture = GOOD[name]
    assert check_source(source, default_device=fixture) == [], name


def test_the_original_multi_file_fails_the_check() -> None:
    """tests/optim/test_optim_multi.py as it was on the H100 (main f2dacbd), its line 40."""
    before = FIXTURE + """
def _tensors(n, dtype, gen, roles, offset):
    base = torch.randn
    t = (base(n + offset, generator=gen) * 1).to(DEVICE, dtype)
def _compare():
    gen = torch.Generator().manual_seed(0)
"""
    assert check_source(before, default_device=True)
