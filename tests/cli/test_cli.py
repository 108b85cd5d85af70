"""``python -m engine``: every subcommand end to end on tiny settings, one-line usage errors
with exit status 2, produced files, and exact resumption from a checkpoint.

Tiny settings: iris (120 training samples), 2-4 stages of width-8 layers, so each command
runs in about a second.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.__main__ import main

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--dataset",
    "iris",
    "--layers",
    "4",
    "--width",
    "8",
    "--batch-size",
    "4",
    "--evals-per-epoch",
    "2",
    "--no-progress",
]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ train


@pytest.mark.parametrize(
    "extra",
    [
        ["--schedule", "gpipe"],
        ["--schedule", "1f1b"],
        ["--schedule", "pipedream"],
        ["--schedule", "2bw"],
        ["--schedule", "vmin"],
        ["--schedule", "looped_bfs", "--virtual-stages", "2"],
        ["--schedule", "pb", "--spike-compensation", "--prediction", "lwp"],
        ["--schedule", "pb", "--prediction", "spectrain"],
        ["--schedule", "pb", "--pipemare-lr", "--discrepancy-correction"],
        ["--schedule", "pb", "--order", "1f1b", "--update-size", "2", "--optimizer", "adam"],
    ],
    ids=lambda e: "-".join(a.lstrip("-") for a in e),
)
def test_train_runs_every_schedule_and_mitigation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str]
) -> None:
    code, out, err = _run(
        capsys,
        "train",
        *TINY,
        "--stages",
        "2",
        "--chunks",
        "2",
        "--epochs",
        "1",
        "--out",
        str(tmp_path),
        *extra,
    )
    assert code == 0, err
    assert "test_acc=" in out
    assert (tmp_path / "checkpoint.safetensors").stat().st_size > 0
    rows = _rows(tmp_path / "metrics.csv")
    assert len(rows) == 2 and {"train_loss", "test_acc", "samples_per_s", "updates"} <= set(rows[0])
    assert 0.0 <= float(rows[-1]["test_acc"]) <= 1.0


def test_train_zbh1_equals_1f1b_bit_for_bit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every catalog schedule trains from the command line; zbh1 only splits 1f1b's backward
    into B and W, so its weights equal 1f1b's bit for bit."""
    from safetensors.torch import load_file

    ckpts = []
    for schedule in ("1f1b", "zbh1"):
        out = tmp_path / schedule
        code, _, err = _run(capsys, "train", *TINY, "--stages", "2", "--chunks", "2",
                            "--epochs", "1", "--out", str(out), "--schedule", schedule)
        assert code == 0, err
        ckpts.append(load_file(str(out / "checkpoint.safetensors")))
    weights = [k for k in ckpts[0] if "weight" in k or "bias" in k]
    assert weights and all(torch.equal(ckpts[0][k], ckpts[1][k]) for k in weights)


def test_train_learns_digits_beyond_chance(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(
        capsys,
        "train",
        "--dataset",
        "digits",
        "--layers",
        "2",
        "--width",
        "32",
        "--stages",
        "2",
        "--chunks",
        "4",
        "--batch-size",
        "8",
        "--schedule",
        "1f1b",
        "--epochs",
        "1",
        "--evals-per-epoch",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    assert float(_rows(tmp_path / "metrics.csv")[-1]["test_acc"]) > 0.6


@pytest.mark.parametrize(
    "method",
    [
        ["--schedule", "pb", "--spike-compensation", "--prediction", "lwp"],
        ["--schedule", "pb", "--pipemare-lr", "--discrepancy-correction"],
        ["--schedule", "2bw", "--chunks", "3"],
        ["--schedule", "pb", "--prediction", "lwp", "--pipemare-lr"],
    ],
    ids=["pb+sc+lwp", "pipemare", "2bw", "lwp+T1"],
)
def test_resume_continues_exactly_where_it_stopped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, method: list[str]
) -> None:
    common = [*TINY, "--stages", "3", "--chunks", "2", *method]
    full, split = tmp_path / "full", tmp_path / "split"
    assert _run(capsys, "train", *common, "--epochs", "3", "--out", str(full))[0] == 0
    assert _run(capsys, "train", *common, "--epochs", "1", "--out", str(split))[0] == 0
    assert _run(capsys, "train", *common, "--epochs", "3", "--out", str(split), "--resume")[0] == 0
    a = load_file(str(full / "checkpoint.safetensors"))
    b = load_file(str(split / "checkpoint.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    timing = {"samples_per_s", "elapsed_s"}
    ra, rb = _rows(full / "metrics.csv"), _rows(split / "metrics.csv")
    assert len(ra) == len(rb) == 6
    for x, y in zip(ra, rb, strict=True):
        assert {k: v for k, v in x.items() if k not in timing} == {
            k: v for k, v in y.items() if k not in timing
        }


@pytest.mark.parametrize(
    "method",
    [["--schedule", "1f1b"], ["--schedule", "pb", "--spike-compensation", "--pipemare-lr"]],
    ids=["1f1b", "pb+sc+T1"],
)
def test_resume_continues_mid_epoch_exactly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    method: list[str],
) -> None:
    """Interrupted at step 25 (epoch 2, between --checkpoint-every 4's commits at 24 and 28
    and after epoch 2's first metric row), the resumed run ends bitwise as the whole one."""
    import engine

    # iris: 120 samples / (2 chunks x 4) = 15 steps per epoch
    common = [*TINY, "--stages", "3", "--chunks", "2", "--checkpoint-every", "4", *method]
    full, split = tmp_path / "full", tmp_path / "split"
    assert _run(capsys, "train", *common, "--epochs", "3", "--out", str(full))[0] == 0
    real, calls = engine.Pipeline.step, []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 25:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(engine.Pipeline, "step", interrupted)
    assert _run(capsys, "train", *common, "--epochs", "3", "--out", str(split))[0] == 130
    monkeypatch.setattr(engine.Pipeline, "step", real)
    state = json.loads((split / "train_state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"]) == (1, 9)
    assert len(_rows(split / "metrics.csv")) == 3  # epoch 1's two rows and epoch 2's first
    code, _, err = _run(capsys, "train", *common, "--epochs", "1", "--out", str(split), "--resume")
    assert code == 2 and "has trained 1 epochs and 9 steps already" in err
    assert _run(capsys, "train", *common, "--epochs", "3", "--out", str(split), "--resume")[0] == 0
    _same_checkpoint(full, split)
    timing = {"samples_per_s", "elapsed_s"}
    ra, rb = _rows(full / "metrics.csv"), _rows(split / "metrics.csv")
    assert len(ra) == len(rb) == 6
    for x, y in zip(ra, rb, strict=True):
        assert {k: v for k, v in x.items() if k not in timing} == {
            k: v for k, v in y.items() if k not in timing
        }


def test_resume_refuses_different_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert (
        _run(
            capsys,
            "train",
            *TINY,
            "--stages",
            "2",
            "--chunks",
            "2",
            "--epochs",
            "1",
            "--out",
            str(tmp_path),
        )[0]
        == 0
    )
    code, _, err = _run(
        capsys,
        "train",
        *TINY,
        "--stages",
        "2",
        "--chunks",
        "2",
        "--epochs",
        "2",
        "--lr",
        "0.5",
        "--out",
        str(tmp_path),
        "--resume",
    )
    assert code == 2 and "different options" in err and "lr" in err
    code, _, err = _run(
        capsys,
        "train",
        *TINY,
        "--stages",
        "2",
        "--chunks",
        "2",
        "--epochs",
        "2",
        "--out",
        str(tmp_path / "nope"),
        "--resume",
    )
    assert code == 2 and "no checkpoint" in err


# ------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
        (["train", "--stages", "20"], "exceeds the model's 16 layers"),
        (["train", "--chunks", "0"], "--chunks must be >= 1"),
        (["train", "--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["train", "--schedule", "gpipe", "--prediction", "lwp"], "--schedule pb only"),
        (["train", "--schedule", "2bw", "--stages", "4", "--chunks", "2"], "chunks >= stages"),
        (["compare", "--methods", "pb,foo"], "unknown method(s) foo"),
        (["compare", "--methods", "pb@sgdx"], "method pb@sgdx: optimizer 'sgdx' is not one of"),
        (["compare", "--methods", "gpipe,pb+sc@nadam"], "method pb+sc@nadam at S=8: --spike-compensation does not apply"),
        (["compare", "--stages", "32"], "exceeds the model's 16 layers"),
        (["compare", "--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["schedule", "zigzag"], "unknown schedule 'zigzag'"),
        (["schedule", "gpipe", "--chunks", "0"], "--chunks 0 must be >= 1"),
        (["nosuchcommand"], "invalid choice"),
        *(
            [(["train", "--device", "cuda"], "no CUDA GPU is visible")]
            if not torch.cuda.is_available()
            else []
        ),
    ],
)
def test_bad_arguments_give_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], needle: str
) -> None:
    code, out, err = _run(
        capsys, *argv, *(["--out", str(tmp_path)] if argv[0] in ("train", "compare") else [])
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0]
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_python_dash_m_engine_exits_2_without_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--stages", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--stages must be >= 1" in proc.stderr


# ------------------------------------------------------------------ compare, schedule, bench


def test_compare_writes_table_plots_and_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(
        capsys,
        "compare",
        *TINY,
        "--methods",
        "gpipe,pb,pb+sc+lwp,pipemare",
        "--stages",
        "2,4",
        "--epochs",
        "1",
        "--target",
        "0.5",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    for name in ("gpipe", "pb+sc+lwp", "pipemare", "upd→target", "bubble"):
        assert name in out
    report = (tmp_path / "report.md").read_text()
    assert "| gpipe | 2 |" in report and "| pipemare | 4 |" in report
    for png in (
        "curves_S2.png",
        "curves_S4.png",
        "depth.png",
        "timeline_gpipe.png",
        "timeline_pb.png",
    ):
        p = tmp_path / png
        assert p.stat().st_size > 1000, png
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in report
    rows = _rows(tmp_path / "summary.csv")
    assert len(rows) == 8
    pb4 = next(r for r in rows if r["method"] == "pb" and r["S"] == "4")
    assert pb4["delays"] == "6/4/2/0"  # 2(S-1-s), measured by the engine
    gp = next(r for r in rows if r["method"] == "gpipe" and r["S"] == "4")
    assert float(gp["bubble"]) > 0.3 and gp["delays"] == "0/0/0/0"


def test_compare_method_at_optimizer_runs_that_optimizer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``pipedream@nadam`` is pipedream with NAdam in a run whose --optimizer is sgd: its row
    equals a run of pipedream under --optimizer nadam, and differs from plain pipedream."""
    args = [*TINY, "--stages", "2", "--epochs", "1", "--evals-per-epoch", "1"]
    code, _, err = _run(capsys, "compare", *args, "--methods", "pipedream,pipedream@nadam",
                        "--out", str(tmp_path / "mixed"))
    assert code == 0, err
    code, _, err = _run(capsys, "compare", *args, "--optimizer", "nadam", "--methods", "pipedream",
                        "--out", str(tmp_path / "nadam"))
    assert code == 0, err
    mixed = {r["method"]: r for r in _rows(tmp_path / "mixed" / "summary.csv")}
    (alone,) = _rows(tmp_path / "nadam" / "summary.csv")
    for key in ("final_acc", "final_loss", "lr", "momentum"):
        assert mixed["pipedream@nadam"][key] == alone[key], key
    assert mixed["pipedream"]["final_loss"] != alone["final_loss"]


def test_schedule_prints_and_draws(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code, out, err = _run(
        capsys,
        "schedule",
        "1f1b",
        "--stages",
        "3",
        "--chunks",
        "4",
        "--png",
        str(png),
        "--trace",
        str(trace),
    )
    assert code == 0, err
    assert "bubble" in out.lower()
    assert png.stat().st_size > 1000 and trace.stat().st_size > 100


def test_bench_on_cpu_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full benchmark would run")
    code, out, _ = _run(capsys, "bench")
    assert code == 0 and "needs a CUDA GPU" in out and "--smoke" in out


def test_progress_is_one_line_per_epoch_or_run_when_not_a_terminal(tmp_path: Path) -> None:
    """Output to a file (not a TTY): no progress-bar redraws, a line per epoch (train) and a
    line per run (compare)."""
    tiny = [a for a in TINY if a != "--no-progress"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    train = subprocess.run(
        [sys.executable, "-m", "engine", "train", *tiny, "--schedule", "1f1b", "--stages", "2", "--epochs", "3",
         "--out", str(tmp_path / "t")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert train.returncode == 0, train.stderr
    assert "\r" not in train.stderr
    lines = [ln for ln in train.stderr.splitlines() if ": epoch " in ln]
    assert [ln.split(": epoch ")[1].split()[0] for ln in lines] == ["1/3", "2/3", "3/3"]
    comp = subprocess.run(
        [sys.executable, "-m", "engine", "compare", *tiny, "--methods", "gpipe,pb", "--stages", "2",
         "--epochs", "1", "--out", str(tmp_path / "c")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert comp.returncode == 0, comp.stderr
    assert "\r" not in comp.stderr
    runs = [ln for ln in comp.stderr.splitlines() if ln.startswith("[")]
    assert len(runs) == 2 and runs[0].startswith("[1/2] S=2 gpipe")
    assert len(comp.stderr.splitlines()) < 20


# ------------------------------------------------------------------ faults during a run

_FAULT = [*TINY, "--stages", "2", "--chunks", "2", "--schedule", "pb"]


def _same_checkpoint(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "checkpoint.safetensors")), load_file(str(b / "checkpoint.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("crash_at", ["checkpoint", "state"])
def test_a_crash_while_committing_an_epoch_never_trains_it_twice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    """Killed at either rename of epoch 2's commit, the resumed run ends exactly as an
    uninterrupted one (before: a new checkpoint beside an old state trained an epoch twice)."""
    import engine.cli.runlog as runlog

    full, split = tmp_path / "full", tmp_path / "split"
    assert _run(capsys, "train", *_FAULT, "--epochs", "3", "--out", str(full))[0] == 0
    real = os.replace
    commits = []

    def crashing(src, dst):
        name = Path(dst).name
        if name in ("checkpoint.safetensors", "train_state.json"):
            commits.append(name)
            target = "checkpoint.safetensors" if crash_at == "checkpoint" else "train_state.json"
            if len(commits) > 2 and name == target:  # epoch 2's commit
                raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(runlog.os, "replace", crashing)
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "3", "--out", str(split))
    assert code == 130, err
    monkeypatch.setattr(runlog.os, "replace", real)
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "3", "--out", str(split), "--resume")
    assert code == 0, err
    _same_checkpoint(full, split)
    assert json.loads((split / "train_state.json").read_text())["epoch"] == 3


def test_a_full_disk_fails_in_one_line_and_keeps_the_previous_epoch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import engine

    out = tmp_path / "run"
    assert _run(capsys, "train", *_FAULT, "--epochs", "1", "--out", str(out))[0] == 0
    before = (out / "checkpoint.safetensors").read_bytes(), (out / "train_state.json").read_text()

    def full_disk(pipe, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(engine, "save", full_disk)
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "2", "--out", str(out), "--resume")
    assert code == 1
    assert err.count("\n") == 1 and "No space left on device" in err and "intact" in err
    assert "Traceback" not in err
    assert ((out / "checkpoint.safetensors").read_bytes(), (out / "train_state.json").read_text()) == before
    assert not list(out.glob("*.next")) and not list(out.glob("*.tmp"))


def test_an_unwritable_out_and_a_corrupt_state_fail_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    assert _run(capsys, "train", *_FAULT, "--epochs", "1", "--out", str(out))[0] == 0
    (out / "train_state.json").write_text("{not json")
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "2", "--out", str(out), "--resume")
    assert code == 1 and err.count("\n") == 1 and "train_state.json" in err and "unreadable" in err

    def read_only(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "1", "--out", str(tmp_path / "ro"))
    assert code == 1 and err.count("\n") == 1 and "Permission denied" in err


def test_resume_with_fewer_epochs_than_done_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    assert _run(capsys, "train", *_FAULT, "--epochs", "2", "--out", str(out))[0] == 0
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "1", "--out", str(out), "--resume")
    assert code == 2 and "has trained 2 epochs already; --epochs 1 is below that" in err
    code, _, err = _run(capsys, "train", *_FAULT, "--epochs", "2", "--out", str(out), "--resume")
    assert code == 0 and "nothing to do" in err


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_resume_at_another_stage_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, schedule: str
) -> None:
    """The loop commits flushed checkpoints, so --resume may change --stages: a synchronous
    run continues bitwise as the uninterrupted one at the first stage count (the exported
    models and the metric rows are equal); an asynchronous one continues (its delays change)."""
    import engine

    common = [*TINY, "--chunks", "2", "--schedule", schedule]
    full, split = tmp_path / "full", tmp_path / "split"
    assert _run(capsys, "train", *common, "--stages", "3", "--epochs", "2", "--out", str(full))[0] == 0
    assert _run(capsys, "train", *common, "--stages", "3", "--epochs", "1", "--out", str(split))[0] == 0
    code, out, err = _run(capsys, "train", *common, "--stages", "2", "--epochs", "2", "--out",
                          str(split), "--resume")
    assert code == 0, err
    assert "S=2" in out
    moved = engine.export(split / "checkpoint.safetensors")
    assert json.loads((split / "train_state.json").read_text())["config"]["stages"] == 2
    if schedule != "1f1b":
        return
    whole = engine.export(full / "checkpoint.safetensors")
    assert moved.keys() == whole.keys() and all(torch.equal(moved[k], whole[k]) for k in whole)
    timing = {"samples_per_s", "elapsed_s"}
    ra, rb = _rows(full / "metrics.csv"), _rows(split / "metrics.csv")
    assert [{k: v for k, v in x.items() if k not in timing} for x in ra] == [
        {k: v for k, v in y.items() if k not in timing} for y in rb]
