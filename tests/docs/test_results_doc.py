"""docs/results.md's comparison tables are the output of the commands they quote
(bench/results_doc.py): a marked table is rewritten from a run's report.md, a check names every
cell that differs, and a fresh run of two methods of the default comparison reproduces their
rows (on the CPU kernels the table was made with)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from bench_support import load_bench

rd = load_bench("results_doc")
ROOT = Path(__file__).resolve().parents[2]
HEADER = "| method | S | final acc | samples/s | bubble |\n|---|---|---|---|---|\n"


def _report(folder: Path, command: str, rows: list[str], cpu: str = "AVX512") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.md").write_text(
        f"# Pipeline methods compared\n\nCommand: `{command}`\n\nWall time: 1 s. Machine: x, "
        f"torch 2.13.0+cpu (1 threads), torch CPU kernels {cpu}, no GPU.\n\n"
        + HEADER + "".join(r + "\n" for r in rows) + "\nAfter the table.\n"
    )
    return folder


DOC = ("# Results\n\n    python -m engine compare --stages 4\n\n"
       "<!-- compare-table: python -m engine compare --stages 4 | cpu: AVX2 -->\n"
       + HEADER + "| gpipe | 4 | 0.9 | 100 | 0.3 |\n| pb | 4 | 0.8 | 90 | 0.0 |\n\nText after.\n")


def test_a_marked_table_is_rewritten_from_the_report_and_checked(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    doc.write_text(DOC)
    run = _report(tmp_path / "run", "python -m engine compare --stages 4 --out run --no-progress",
                  ["| gpipe | 4 | 0.9 | 300 | 0.3 |", "| pb | 4 | 0.7 | 80 | 0.0 |"])
    assert rd.main([str(run), "--doc", str(doc), "--check"]) == 1  # pb's final acc moved
    assert rd.main([str(run), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| pb | 4 | 0.7 | 80 | 0.0 |" in text and "| pb | 4 | 0.8 |" not in text
    assert "<!-- compare-table: python -m engine compare --stages 4 | cpu: AVX512 -->" in text
    assert text.startswith("# Results\n") and text.endswith("\nText after.\n")
    assert rd.main([str(run), "--doc", str(doc), "--check"]) == 0


def test_the_check_names_each_cell_and_ignores_samples_per_second() -> None:
    doc = (HEADER + "| gpipe | 4 | 0.9 | 100 | 0.3 |\n| pb | 4 | 0.8 | 90 | 0.0 |").splitlines()
    fresh = (HEADER + "| gpipe | 4 | 0.9 | 999 | 0.3 |\n| pb | 4 | 0.7 | 90 | 0.0 |").splitlines()
    assert rd.differences(doc, fresh) == ["pb S=4, final acc: the doc says 0.8, the run 0.7"]
    assert rd.differences(doc, fresh[:3], {"gpipe"}) == []  # a run of some methods: their rows
    assert rd.differences(doc, fresh[:3]) == ["pb S=4: missing from the run"]


def test_a_run_of_another_command_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    doc.write_text(DOC)
    run = _report(tmp_path / "run", "python -m engine compare --stages 8", ["| gpipe | 8 | 0.9 | 1 | 0.4 |"])
    with pytest.raises(SystemExit, match="no table of `python -m engine compare --stages 8` is marked"):
        rd.main([str(run), "--doc", str(doc)])
    assert doc.read_text() == DOC


def test_every_marked_table_quotes_a_command_the_page_shows() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    marked = rd.marked_tables(text)
    assert rd.command_key("python -m engine compare") in marked
    shown = {rd.command_key(m[1]) for m in re.finditer(r"^    (python -m engine compare.*?)\s*$", text, re.M)}
    assert set(marked) <= shown


@pytest.mark.slow  # two methods of the default comparison: ~25 s on 2 cores
def test_a_fresh_run_reproduces_the_default_tables_rows(tmp_path: Path) -> None:
    """spectrain is the row that moves with the CPU kernels; gpipe is the reference."""
    from engine.__main__ import main

    _, _, cpu = rd.marked_tables((ROOT / "docs" / "results.md").read_text())[rd.command_key("python -m engine compare")]
    mine = torch.backends.cpu.get_cpu_capability()
    if mine != cpu:
        pytest.skip(f"the default table was made with torch's {cpu} CPU kernels, this machine runs "
                    f"{mine}, which round differently (docs/results.md says which cells move)")
    out = tmp_path / "run"
    assert main(["compare", "--methods", "gpipe,spectrain", "--no-progress", "--out", str(out)]) == 0
    assert rd.main([str(out), "--check", "--against", "python -m engine compare"]) == 0
