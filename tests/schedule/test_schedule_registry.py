"""The tests' schedule registry (tests/schedules.py) is derived from the catalog and its
subsets mean what their names say."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from schedules import (
    ALL,
    ASYNC,
    FREE_UPDATE_SIZE,
    LIVE_ASYNC,
    SPLIT_BACKWARD,
    STASHED,
    SYNC,
    SYNC_WHOLE_BACKWARD,
    VARIANTS,
    chunks_for,
    variant,
)

from engine.cli.config import SCHEDULES as CLI
from engine.cli.schedule import add_arguments
from engine.schedule.catalog import FAMILIES, NAMES, SCHEDULES, SYNCHRONOUS


def test_subsets_partition_the_catalog() -> None:
    assert ALL == SCHEDULES
    assert set(SYNC) == SYNCHRONOUS and set(SYNC) | set(ASYNC) == set(ALL)
    assert not set(SYNC) & set(ASYNC)
    assert set(STASHED) | set(LIVE_ASYNC) == set(ASYNC) and not set(STASHED) & set(LIVE_ASYNC)
    assert set(SYNC_WHOLE_BACKWARD) | set(SPLIT_BACKWARD) >= set(SYNC)
    assert all(FAMILIES[n].weights == "live" for n in LIVE_ASYNC)
    assert all(not FAMILIES[n].per_minibatch for n in FREE_UPDATE_SIZE)


def test_variants_cover_every_order() -> None:
    pairs = [variant(v) for v in VARIANTS]
    assert sorted({n for n, _ in pairs}) == sorted(ALL)
    for name, fam in FAMILIES.items():
        assert {o or fam.default_order for n, o in pairs if n == name} == set(fam.orders)
    with pytest.raises(ValueError, match="not a schedule variant"):
        variant("pb-sideways")
    assert chunks_for("2bw", 4, 2) == 4 and chunks_for("pb", 4, 2) == 2


def test_one_list_of_names_everywhere() -> None:
    """The API's error, the command line, README and ALGORITHMS.md list the catalog's families
    in the catalog's order (the API's message: tests/schedule/test_schedule_auto.py)."""
    root = Path(__file__).resolve().parents[2]
    readme = root.joinpath("README.md").read_text()
    listed = readme.split("same thirteen in the same order):", 1)[1].split("; or", 1)[0]
    assert tuple(re.findall(r"`([\w-]+)`", listed)) == NAMES
    algorithms = root.joinpath("docs", "ALGORITHMS.md").read_text()
    table = algorithms.split("## Schedules (what runs when)", 1)[1].split("\n\n", 2)[1]
    rows = list(dict.fromkeys(re.findall(r"^\| `([\w-]+)`", table, flags=re.M)))
    assert tuple(rows) == NAMES
    assert CLI[: len(NAMES)] == NAMES and CLI[len(NAMES):] == ("auto",)
    p = argparse.ArgumentParser()
    add_arguments(p)
    name_help = next(a.help for a in p._actions if a.dest == "name")
    assert ", ".join(NAMES) in name_help
