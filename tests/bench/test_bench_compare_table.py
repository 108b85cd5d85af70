"""bench/compare_table.py: rows of several compare runs merged by (method, depth), seeds read
from each run's recorded command, the spread computed over the seeds present."""

from __future__ import annotations

import csv
from pathlib import Path

from bench_support import load_bench

FIELDS = ["method", "S", "B", "final_acc", "final_loss", "weight_kib", "delays"]


def _run(out: Path, seed: int, rows: list[dict]) -> Path:
    out.mkdir()
    (out / "report.md").write_text(f"Command: `python -m engine compare --task lm --seed {seed} --out {out}`\n")
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return out


def test_seeds_of_one_method_become_one_row_with_mean_and_sd(tmp_path: Path) -> None:
    ct = load_bench("compare_table")
    row = dict(method="pb", S=8, B=1, weight_kib=706, delays="14/0")
    a = _run(tmp_path / "a", 0, [row | dict(final_acc=0.2, final_loss=2.5),
                                 dict(row, method="gpipe", final_acc=0.3, final_loss=2.2)])
    b = _run(tmp_path / "b", 1, [row | dict(final_acc=0.4, final_loss=2.1)])
    lines = ct.table(ct.load([a, b])).splitlines()
    pb = next(line for line in lines if line.startswith("| pb |"))
    assert "0.200 / 0.400 (0.300 ± 0.141)" in pb and "2.500 / 2.100 (2.300 ± 0.283)" in pb
    assert "| 0,1 |" in pb
    gpipe = next(line for line in lines if line.startswith("| gpipe |"))
    assert "| 0.300 | 2.200 | 0 |" in gpipe
