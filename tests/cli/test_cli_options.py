"""The CLI's options as a user meets them: every option explains itself in --help, the
recomputation default is the API's, ``--recompute``'s old name still works (with a warning),
and a resumed run reports what it did: nothing written when nothing was left to train, and
samples/s over the whole metric row even when the row straddles the resume."""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import types
from pathlib import Path

import pytest

import engine
from engine.__main__ import build_parser, main
from engine.cli.config import TrainConfig
from engine.runtime.setup.config import DEFAULT_CHECKPOINT

TINY = ["--dataset", "iris", "--layers", "4", "--width", "8", "--batch-size", "4",
        "--evals-per-epoch", "2", "--no-progress", "--stages", "3", "--chunks", "2"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_every_option_of_every_command_has_help() -> None:
    missing = [
        f"{name} {'/'.join(a.option_strings)}"
        for name, sp in _subparsers().items()
        for a in sp._actions
        if a.option_strings and not (a.help or "").strip()
    ]
    assert not missing, f"options without help text: {missing}"


def test_recomputation_default_is_the_same_in_api_and_cli() -> None:
    api = inspect.signature(engine.Pipeline).parameters["checkpoint"].default
    assert api == DEFAULT_CHECKPOINT
    assert TrainConfig.__dataclass_fields__["checkpoint"].default == api
    for command in ("train", "compare"):
        assert getattr(_parse(command), "checkpoint") == api, command


def test_recompute_sets_the_mode_and_old_checkpoint_name_warns() -> None:
    assert _parse("train", "--recompute", "except_last").checkpoint == "except_last"
    with pytest.warns(DeprecationWarning, match="--checkpoint is deprecated.*--recompute always"):
        ns = _parse("train", "--checkpoint", "always")
    assert ns.checkpoint == "always"
    with pytest.warns(DeprecationWarning):
        assert _parse("compare", "--checkpoint", "except_last").checkpoint == "except_last"
    # --checkpoint-every is a different option (saving), untouched by the alias
    assert _parse("train", "--checkpoint-every", "3").checkpoint_every == 3


def test_bad_recompute_value_is_one_line_naming_the_choices(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("train", "--recompute", "sometimes")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'sometimes'" in err and "except_last" in err


def test_resume_of_a_finished_run_writes_nothing_and_says_so(capsys, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["train", *TINY, "--epochs", "1", "--out", str(out), "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "wrote" not in stdout and "trained nothing" in stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_resumed_row_counts_samples_per_second_over_both_halves(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock that advances one second per step: every metric row is then exactly
    8 samples/s (2 chunks x 4 samples per step), also the row a mid-epoch resume splits."""
    import engine.cli.loop as loop

    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real, calls = engine.Pipeline.step, []

    def ticking(self, *a, **k):
        calls.append(1)
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt
        clock[0] += 1.0
        return real(self, *a, **k)

    monkeypatch.setattr(engine.Pipeline, "step", ticking)
    common = [*TINY, "--checkpoint-every", "4", "--epochs", "2"]
    out = tmp_path / "run"
    stop_at = 25  # iris: 15 steps per epoch; epoch 2's second row straddles the resume
    assert main(["train", *common, "--out", str(out)]) == 130
    state = json.loads((out / "train_state.json").read_text())
    assert state["step_in_epoch"] == 9 and state["seg_seconds"] == 1.0
    stop_at = 0
    assert main(["train", *common, "--out", str(out), "--resume"]) == 0
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    assert [float(r["samples_per_s"]) for r in rows] == [8.0] * 4
    assert float(rows[-1]["elapsed_s"]) == 30.0
    capsys.readouterr()


def test_compare_over_seeds_draws_the_final_metrics_and_explains_the_report(
    capsys, tmp_path: Path
) -> None:
    code = main(["compare", *TINY[:-4], "--stages", "2", "--epochs", "1", "--methods",
                 "gpipe,pb", "--seeds", "0,1", "--target", "0.5", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    with open(tmp_path / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["seed"]) for r in rows] == [
        ("gpipe", "0"), ("gpipe", "1"), ("pb", "0"), ("pb", "1")]
    assert rows[0]["last_epoch_loss"] != rows[1]["last_epoch_loss"]  # two seeds, two runs
    for r in rows:
        assert float(r["final_acc_min"]) <= float(r["final_acc"]) <= float(r["final_acc_max"])
    report = (tmp_path / "report.md").read_text()
    assert "| gpipe (seed 1) | 2 |" in report
    assert "(final_S2.png)" in report and (tmp_path / "final_S2.png").stat().st_size > 1000
    assert "dots: 2 seeds" in report
    # every column of the table is explained, the noisy ones say so
    for column in ("*final acc*", "*train loss*", "*samples/s*", "*weights KiB*", "*act KiB*",
                   "*delays*", "*bubble*", "*upd→target*", "*last-epoch mean*"):
        assert column in report, column
    assert "noise" in report and "never drain" in report
    assert len(list((tmp_path / "runs").iterdir())) == 4


def test_timeline_titles_say_why_an_async_bubble_differs_from_the_table(
    monkeypatch, tmp_path: Path
) -> None:
    import engine.schedule
    from engine.cli.plots import render_timelines

    titles = {}
    monkeypatch.setattr(engine.schedule, "render_timeline",
                        lambda sched, path, title: titles.__setitem__(path.stem, title))
    render_timelines(tmp_path, 8, 8, ["gpipe", "pb"])
    assert "drains every mini-batch" in titles["timeline_gpipe"]
    assert "fill + drain" in titles["timeline_pb"] and "~0 over a run" in titles["timeline_pb"]


def test_bad_seeds_are_one_line(capsys) -> None:
    assert main(["compare", "--seeds", "0,x"]) == 2
    assert "--seeds '0,x'" in capsys.readouterr().err
