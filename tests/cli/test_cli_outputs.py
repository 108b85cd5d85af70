"""One run per output folder (engine/cli/outdir.py): ``train``, ``compare`` and ``bench`` refuse
to write over an earlier run's files in their ``--out`` (one line naming the files and the
options that go on), ``--overwrite`` replaces them, ``--resume`` still continues a run; the
benchmarks write under ``out/`` unless ``--out`` names another folder, never into the tracked
``bench/results``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.__main__ import main

REPO = Path(__file__).resolve().parents[2]
TINY = ["--dataset", "iris", "--layers", "4", "--width", "8", "--batch-size", "4",
        "--evals-per-epoch", "1", "--no-progress", "--stages", "2", "--epochs", "1"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_refuses_an_earlier_runs_folder_and_changes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "train"
    assert _run(capsys, "train", *TINY, "--schedule", "1f1b", "--out", str(out))[0] == 0
    before = _files(out)
    assert {"checkpoint.safetensors", "train_state.json", "metrics.csv"} <= set(before)
    code, _, err = _run(capsys, "train", *TINY, "--schedule", "pb", "--out", str(out))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "holds an earlier run's outputs" in line and "checkpoint.safetensors" in line
    assert "--resume" in line and "--overwrite" in line and "--out DIR" in line
    assert _files(out) == before


def test_train_overwrite_replaces_the_run_and_resume_still_continues_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "train"
    assert _run(capsys, "train", *TINY, "--schedule", "1f1b", "--out", str(out))[0] == 0
    (out / "notes.txt").write_text("mine")  # not a run output: left alone
    code, _, err = _run(capsys, "train", *TINY, "--schedule", "gpipe", "--out", str(out), "--overwrite")
    assert code == 0, err
    assert '"schedule": "gpipe"' in (out / "train_state.json").read_text()
    assert (out / "notes.txt").read_text() == "mine"
    args = list(TINY)
    args[args.index("--epochs") + 1] = "2"
    code, _, err = _run(capsys, "train", *args, "--schedule", "gpipe", "--out", str(out), "--resume")
    assert code == 0, err
    assert '"epoch": 2' in (out / "train_state.json").read_text()
    code, _, err = _run(capsys, "train", *TINY, "--out", str(out), "--resume", "--overwrite")
    assert code == 2 and "pass one" in err


def test_compare_refuses_an_earlier_comparison_and_overwrite_clears_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["compare", *TINY, "--methods", "gpipe", "--out", str(tmp_path)]
    assert _run(capsys, *args)[0] == 0
    (tmp_path / "runs" / "S9-stale").mkdir()  # a run the next comparison would not write
    before = _files(tmp_path)
    code, _, err = _run(capsys, *args)
    assert code == 2 and "report.md" in err and "runs/" in err and "--overwrite" in err
    assert "--resume" not in err  # compare cannot continue a comparison
    assert _files(tmp_path) == before
    code, _, err = _run(capsys, *args, "--overwrite")
    assert code == 0, err
    assert not (tmp_path / "runs" / "S9-stale").exists()
    assert (tmp_path / "report.md").exists()


def test_bench_smoke_writes_under_out_bench_and_never_over_an_earlier_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full benchmark would run")
    monkeypatch.chdir(tmp_path)
    smoke = ["bench", "--smoke", "--kernels", "sgd", "--dtypes", "fp32", "--sizes", "64KiB"]
    code, out, err = _run(capsys, *smoke)
    assert code == 0, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "out/bench/optim.csv", "out/bench/optim.png", "out/bench/optim_ratios.csv"]
    before = _files(tmp_path)
    code, _, err = _run(capsys, *smoke)
    assert code == 2 and "out/bench holds an earlier run's outputs" in err
    assert _files(tmp_path) == before
    assert _run(capsys, *smoke, "--overwrite")[0] == 0


_BENCH_DEFAULT = re.compile(r"""default\s*=\s*(?:Path\()?["']bench""")


def test_no_benchmark_writes_into_the_repository_by_default() -> None:
    """Every bench script's (and the CLI's) ``--out`` default lies under out/: the tracked
    bench/results is written only when asked for by name."""
    scripts = sorted((REPO / "bench").glob("*.py")) + [REPO / "engine" / "cli" / "bench.py"]
    assert [p.name for p in scripts if _BENCH_DEFAULT.search(p.read_text())] == []
    outputs = (REPO / "bench" / "outputs.py").read_text()
    assert 'DEFAULT_OUT = Path("out/bench")' in outputs
    users = [p.name for p in scripts if "default=DEFAULT_OUT" in p.read_text()]
    assert {"optim.py", "overhead.py", "recompute.py", "pipeline_gloo.py", "pipeline_nccl.py",
            "harness.py"} <= set(users)
