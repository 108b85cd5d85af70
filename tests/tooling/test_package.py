"""The package's public surface: lazy names resolve, the version is exported, info runs."""

from __future__ import annotations

import subprocess
import sys

import engine


def test_public_names_resolve() -> None:
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name
    assert engine.__version__.count(".") == 2
    assert callable(engine.Pipeline) and callable(engine.save) and callable(engine.load)
    assert callable(engine.flatten_) and callable(engine.optim.SGD)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        engine.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("engine.no_such_name resolved")


def test_info_command_reports_build_and_triton_mode() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine", "info"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    for key in ("engine", "torch", "triton", "extension", "extension_cuda", "triton_mode", "gpu"):
        assert any(line.split()[0] == key for line in out.splitlines() if line.strip()), key
    assert "built" in out


def test_cli_bad_command_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "frobnicate"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
