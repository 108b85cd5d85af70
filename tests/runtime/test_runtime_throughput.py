"""``stats()["throughput"]`` (engine/runtime/state/throughput.py) and the CLI's progress line: step
time, samples/s, tokens/s for token ids, the measured bubble next to the modelled one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from engine import Pipeline
from engine.runtime.state.throughput import batch_size

REPO = Path(__file__).resolve().parents[2]


def test_counts_samples_and_tokens() -> None:
    assert batch_size(torch.randn(8, 3), torch.randn(8)) == (8, None)
    assert batch_size(torch.randint(0, 9, (4, 7)), None) == (4, 28)
    assert batch_size(None, torch.randint(0, 9, (4, 7))) == (4, 28)  # a rank with targets only
    assert batch_size({"ids": torch.randint(0, 9, (2, 5)), "mask": torch.ones(2, 5, dtype=torch.bool)},
                      None) == (2, 10)
    assert batch_size(None, None) == (None, None)


def test_throughput_in_stats() -> None:
    pipe = Pipeline([nn.Embedding(10, 8), nn.Linear(8, 10)], schedule="1f1b", chunks=2,
                    loss_fn=lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert pipe.stats()["throughput"]["samples_per_s"] is None  # nothing ran yet
    for _ in range(3):
        pipe.step(torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5)))
    tp = pipe.stats()["throughput"]
    assert tp["steps"] == 3
    total = tp["step_time_s"] * tp["steps"]
    assert abs(tp["samples_per_s"] * total - 12) < 1e-6
    assert abs(tp["tokens_per_s"] * total - 60) < 1e-6
    assert 0 < tp["last_step_time_s"] and 0.0 <= tp["bubble_measured"] < 1.0
    st = pipe.stats()
    assert tp["bubble_modelled"] == st["bubble_fraction"]
    assert tp["bubble_measured"] == st["bubble_fraction_wall"]  # local: the replay
    assert sum(s.busy_ns for s in pipe.stages) > 0
    pipe.reset_stats()
    tp = pipe.stats()["throughput"]
    assert tp["steps"] == 0 and tp["samples_per_s"] is None


def test_cli_progress_line_shows_speed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--task", "lm", "--epochs", "1", "--stages", "2",
         "--schedule", "1f1b", "--out", str(tmp_path / "t"), "--evals-per-epoch", "1",
         "--layers", "2", "--width", "8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ": epoch " in ln]
    assert "samples/s" in line and "tokens/s" in line and "step " in line
    assert re.search(r"idle share of a step measured \d\.\d\d, model \d\.\d\d\)", line), line
