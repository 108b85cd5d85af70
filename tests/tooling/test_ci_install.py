"""`.ci/install` reuses the built engine._C only when nothing that decides its bits changed
(.ci/build_stamp.py): sources, torch, build flags, the built file and the editable install.
Each test builds a tiny fake checkout, stamps it, changes one thing and reads the decision."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("build_stamp", ROOT / ".ci" / "build_stamp.py")
stamp = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(stamp)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake checkout, stamped, that counts as installed editable from itself."""
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "arena.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "csrc" / "cuda" / "arena_cuda.cu").write_text("// cuda\n")
    for name in ("setup.py", "CMakeLists.txt", "pyproject.toml"):
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "_version.py").write_text('__version__ = "0.1.0"\n')
    (tmp_path / "engine" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF built")
    monkeypatch.setattr(stamp, "installed_here", lambda root=None: None)
    stamp.write(tmp_path, env={})
    return tmp_path


def test_unchanged_build_is_reused(checkout):
    reuse, why = stamp.decide(checkout, env={})
    assert reuse, why
    assert "unchanged" in why


@pytest.mark.parametrize(
    "change",
    ["csrc/arena.cpp", "csrc/cuda/arena_cuda.cu", "setup.py", "CMakeLists.txt", "engine/_version.py"],
)
def test_changed_source_triggers_a_rebuild(checkout, change):
    before = stamp.source_hash(checkout)
    (checkout / change).write_text((checkout / change).read_text() + "// edited\n")
    assert stamp.source_hash(checkout) != before
    reuse, why = stamp.decide(checkout, env={})
    assert not reuse and "sources" in why


def test_new_or_renamed_source_triggers_a_rebuild(checkout):
    (checkout / "csrc" / "new.cpp").write_text("int g();\n")
    assert stamp.decide(checkout, env={})[0] is False
    (checkout / "csrc" / "new.cpp").rename(checkout / "csrc" / "other.cpp")
    assert stamp.decide(checkout, env={})[0] is False


def test_changed_build_flag_triggers_a_rebuild(checkout):
    reuse, why = stamp.decide(checkout, env={"TORCH_CUDA_ARCH_LIST": "9.0"})
    assert not reuse and "env" in why
    assert stamp.decide(checkout, env={"UNRELATED": "1"})[0] is True


def test_changed_torch_triggers_a_rebuild(checkout, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    reuse, why = stamp.decide(checkout, env={})
    assert not reuse and "torch" in why


def test_replaced_or_missing_module_triggers_a_rebuild(checkout):
    so = next((checkout / "engine").glob("_C*.so"))
    so.write_bytes(b"\x7fELF something else")
    reuse, why = stamp.decide(checkout, env={})
    assert not reuse and "not the file the stamp recorded" in why
    so.unlink()
    assert stamp.decide(checkout, env={}) == (False, "no single engine/_C*.so to reuse")


def test_fresh_checkout_builds(tmp_path):
    reuse, why = stamp.decide(tmp_path, env={})
    assert not reuse and "first build" in why


def test_install_elsewhere_triggers_a_rebuild(checkout, monkeypatch):
    monkeypatch.setattr(
        stamp, "installed_here", lambda root=None: "pipeline-engine is installed from file:///x"
    )
    reuse, why = stamp.decide(checkout, env={})
    assert not reuse and "installed from" in why


def test_real_install_check_names_the_other_checkout(tmp_path):
    """The real check (no monkeypatch): this tmp dir is not where pipeline-engine comes from."""
    problem = stamp.installed_here(tmp_path)
    assert problem is not None
    assert tmp_path.as_uri() in problem or "not installed" in problem


def test_install_script_checks_the_stamp_before_building():
    text = (ROOT / ".ci" / "install").read_text()
    body = text[text.index("install_project() {"):]
    assert body.index("build_stamp.py check") < body.index("pip install") < body.index(
        "build_stamp.py write"
    )
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "install")]).returncode == 0


def test_write_without_a_built_module_does_not_fail_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stamp, "ROOT", tmp_path)
    monkeypatch.setattr(stamp, "built_module", lambda root=None: None)
    assert stamp.main(["build_stamp.py", "write"]) == 0
    assert "the next install rebuilds" in capsys.readouterr().out
    assert not (tmp_path / stamp.STAMP).exists()
