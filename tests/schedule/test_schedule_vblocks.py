"""V-Min and V-Half as schedule data: the building blocks repeat without collision, the peak
activation memory is the paper's (R+4)//3 and (R+2)//2 micro-batches of a rank's layers where
1F1B holds R, the bubble is below 1F1B's, every generated program validates, and the catalog,
``generate``, the command line and the CSV export know them."""

from __future__ import annotations

import pytest

from engine.schedule import analyze, family, from_csv, generate, to_csv, validate, vhalf, vmin, zbv
from engine.schedule.vblocks import vhalf_block, vmin_block, block_peak, block_slots

BUILDERS = {"vmin": vmin, "vhalf": vhalf}
#: the paper's peak, in micro-batches of one rank's layers (two V stages each)
CLAIM = {"vmin": lambda R: (R + 4) // 3, "vhalf": lambda R: (R + 2) // 2}


@pytest.mark.parametrize("block", [vmin_block, vhalf_block], ids=["vmin", "vhalf"])
def test_block_repeats_every_six_slots_without_collision(block) -> None:  # noqa: ANN001
    for R in range(1, 13):
        rows, gap = block_slots(block, R)
        for r, row in enumerate(rows):
            assert len({t % 6 for t in row}) == 4, (R, r, row)
        # the search finds the smallest gap: one less collides somewhere (or it is 0)
        if gap:
            smaller = [block(R, r, gap - 1) for r in range(R)]
            assert any(len({t % 6 for t in row}) < 4 for row in smaller), (R, gap)
    assert [block_slots(vmin_block, R)[1] for R in (3, 4, 6)] == [2, 0, 2]
    assert [block_slots(vhalf_block, R)[1] for R in (3, 4, 5)] == [0, 3, 0]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_peak_memory_is_the_papers(name: str) -> None:
    """In V stages (half a rank's layers) the rank peak is twice the claim, on every rank,
    once the pipeline is full (M >= 2R); zbv holds 1F1B's 2R."""
    build = BUILDERS[name]
    for R in range(1, 11):
        for M in (2 * R, 3 * R + 1):
            peaks = analyze(build(R, M)).rank_activation_peak
            assert min(peaks) == max(peaks) == 2 * CLAIM[name](R), (name, R, M, peaks)
            assert max(peaks) == block_peak(vmin_block if name == "vmin" else vhalf_block, R, M)
    for R in (4, 8):
        assert max(analyze(zbv(R, 2 * R)).rank_activation_peak) == 2 * R
    # p = 8, m = 16: 0.5x and 0.625x of 1F1B's R = 8 micro-batches of a rank's layers
    assert max(analyze(vmin(8, 16)).rank_activation_peak) / 2 / 8 == 0.5
    assert max(analyze(vhalf(8, 16)).rank_activation_peak) / 2 / 8 == 0.625


def test_bubble_below_1f1b() -> None:
    """With F = B = W (V stages half of 1F1B's: F 0.5, whole B 1) the idle time beyond the
    work, as a share of 1F1B's, stays near the paper's 1/2 (V-Half) and 2/3 (V-Min)."""
    for R, M in ((4, 8), (4, 16), (8, 16), (8, 32)):
        flat = analyze(generate("1f1b", R, M), {"F": 1, "B": 2}).makespan - 3 * M
        share = {}
        for name, build in BUILDERS.items():
            rep = analyze(build(R, M), {"F": 0.5, "B": 1})
            share[name] = (rep.makespan - 3 * M) / flat
        assert 0.45 <= share["vhalf"] <= 0.56 and 0.58 <= share["vmin"] <= 0.67, (R, M, share)
        assert share["vhalf"] < share["vmin"]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_size_validates_with_its_bound(name: str) -> None:
    for R in range(1, 7):
        for M in range(1, 3 * R + 2):
            s = BUILDERS[name](R, M, steps=1 + (M % 2))
            validate(s)  # deadlock-free, every gradient applied once, within the catalog bound
            assert s.placement == tuple((r, 2 * R - 1 - r) for r in range(R)) or R == 1
            assert all(len(s.split_mbs(st)) == M * s.steps for st in range(2 * R))


def test_catalog_rows_and_generate() -> None:
    for name in BUILDERS:
        row = family(name)
        assert row.synchronous and row.split_backward and row.is_program
        assert row.placement.per_rank == 2 and not row.takes_virtual_stages
        assert generate(name, 8, 6) == BUILDERS[name](4, 6)  # 8 stages: 4 ranks as a V
        with pytest.raises(ValueError, match="multiple of 2"):
            generate(name, 5, 6)
        with pytest.raises(ValueError, match="exactly 2 stages per rank"):
            row.program_for(8, 6, virtual_stages=4)


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_csv_export_reads_back(name: str, fmt: str) -> None:
    s = BUILDERS[name](4, 8)
    assert from_csv(to_csv(s, format=fmt), name=name, order=name) == s


def test_cli_prints_analysis(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.__main__ import main

    for name in BUILDERS:
        assert main(["schedule", name, "-S", "4", "-M", "8", "--width", "0"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"schedule {name} stages=8 chunks=8")
        peak = 2 * CLAIM[name](4)
        assert f"activation peak {peak} micro-batches" in out and "bubble" in out
