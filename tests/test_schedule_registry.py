"""The tests' schedule registry (tests/schedules.py) is derived from the catalog and its
subsets mean what their names say."""

from __future__ import annotations

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

from engine.schedule.catalog import FAMILIES, SCHEDULES, SYNCHRONOUS


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
