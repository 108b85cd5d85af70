"""Golden files: the text form of a few schedules, compared exactly.

A change to a generator shows up as a diff of these files in review. To regenerate them
after an intended change, run

    ENGINE_REGEN_GOLDEN=1 python3 -m pytest tests/schedule/test_schedule_golden.py

and review the diff of tests/golden/schedules/ before committing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.schedule import format_schedule, generate, parse, validate

GOLDEN_DIR = Path(__file__).parent / "golden" / "schedules"
REGEN = os.environ.get("ENGINE_REGEN_GOLDEN") == "1"

# (name, stages, chunks, steps, update_size, order)
CASES: list[tuple[str, int, int, int, int | None, str | None]] = [
    ("naive", 2, 2, 1, None, None),
    ("gpipe", 3, 4, 1, None, None),
    ("1f1b", 4, 8, 1, None, None),
    ("1f1b", 2, 2, 2, None, None),
    ("zbh1", 4, 8, 1, None, None),
    ("zbh1", 2, 2, 2, None, None),
    ("pipedream", 3, 2, 2, None, None),
    ("pipedream", 3, 4, 1, 2, None),
    ("2bw", 3, 3, 2, None, None),
    ("pb", 3, 3, 1, None, "dataflow"),
    ("pb", 3, 3, 2, None, "1f1b"),
    ("pb", 4, 2, 2, 2, "dataflow"),
]


def _filename(name: str, S: int, M: int, T: int, k: int | None, order: str | None) -> str:
    sched = generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    return f"{name}-{sched.order}-S{S}-M{M}-T{T}-k{sched.update_size}.txt"


@pytest.mark.parametrize("case", CASES, ids=lambda c: _filename(*c))
def test_golden(case: tuple[str, int, int, int, int | None, str | None]) -> None:
    name, S, M, T, k, order = case
    sched = generate(name, stages=S, chunks=M, steps=T, update_size=k, order=order)
    text = format_schedule(sched)
    path = GOLDEN_DIR / _filename(*case)
    if REGEN:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with ENGINE_REGEN_GOLDEN=1 to create it"
    golden = path.read_text()
    assert text == golden, (
        f"{path.name} differs from the generator's output; if the change is intended, "
        f"regenerate with ENGINE_REGEN_GOLDEN=1 and review the diff"
    )
    parsed = parse(golden)
    assert parsed == sched
    validate(parsed)


def test_no_stale_golden_files() -> None:
    expected = {_filename(*c) for c in CASES}
    present = {p.name for p in GOLDEN_DIR.glob("*.txt")}
    assert present <= expected, f"golden files without a case: {sorted(present - expected)}"
