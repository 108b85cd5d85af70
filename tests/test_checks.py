"""Tests for engine._checks: the shared argument checks keep their exact types and messages."""

from __future__ import annotations

import ast
import pathlib

import pytest

import engine._checks
from engine._checks import check_positive_int


def test_check_positive_int_accepts_and_returns() -> None:
    assert check_positive_int("stages", 1, "fix") == 1
    assert check_positive_int("stages", 7, "fix") == 7


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "stages must be >= 1, got 0; use one"),
        (-3, ValueError, "stages must be >= 1, got -3; use one"),
        (2.0, TypeError, "stages must be an int, got 2.0"),
        (True, TypeError, "stages must be an int, got True"),
        ("2", TypeError, "stages must be an int, got '2'"),
    ],
)
def test_check_positive_int_rejects(value: object, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        check_positive_int("stages", value, "use one")
    assert str(info.value) == message


def test_checks_is_a_leaf_module() -> None:
    """Any engine module may import _checks, so _checks must import nothing from engine."""
    tree = ast.parse(pathlib.Path(engine._checks.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "engine" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and (node.module or "").split(".")[0] != "engine"
