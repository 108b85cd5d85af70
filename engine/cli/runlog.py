"""What a run leaves in ``--out``: the metrics CSV, the resume state, and how both are written.

Why: ``--resume`` must continue exactly where an earlier run stopped, and only with the same
options; so ``train_state.json`` records the configuration (minus the options that may change
between a run and its resumption, e.g. ``--epochs``) beside the epoch, sample count and
training time, and a resumed run is refused with the differing options named. Every file is
written to a temporary name and moved into place with ``os.replace``, so a run killed
mid-write leaves the previous, consistent files (the checkpoint itself is ``engine.save``'s).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.cli import CLIError
from engine.cli.config import TrainConfig

__all__ = [
    "CHECKPOINT_FILE",
    "STATE_FILE",
    "METRICS_FILE",
    "METRIC_FIELDS",
    "resume_key",
    "read_state",
    "write_state",
    "write_metrics",
    "read_metrics",
]

CHECKPOINT_FILE = "checkpoint.safetensors"
STATE_FILE = "train_state.json"
METRICS_FILE = "metrics.csv"
METRIC_FIELDS = (
    "epoch",
    "step",
    "samples",
    "updates",
    "train_loss",
    "train_acc",
    "test_loss",
    "test_acc",
    "samples_per_s",
    "elapsed_s",
)
#: config fields that may differ between a run and its resumption
_RESUME_FREE = {"epochs", "progress", "out", "resume", "device", "threads"}


def resume_key(cfg: TrainConfig) -> dict[str, Any]:
    """The options a resumption must repeat (saved in, and compared with, the state file)."""
    return {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE}


def read_state(out: Path, cfg: TrainConfig) -> dict[str, Any]:
    """The state of the run in ``out``, after checking that ``cfg`` may resume it."""
    state_path = out / STATE_FILE
    if not state_path.exists() or not (out / CHECKPOINT_FILE).exists():
        raise CLIError(
            f"--resume: no checkpoint in {out} (expected {CHECKPOINT_FILE} and {STATE_FILE}); "
            "run without --resume first, or point --out at the earlier run"
        )
    state = json.loads(state_path.read_text())
    saved = state["config"]
    mine = resume_key(cfg)
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in mine.items() if saved.get(k) != v
    ]
    if diff:
        raise CLIError(
            f"--resume: the run in {out} used different options ({'; '.join(diff)}); "
            "repeat its options (only --epochs may grow) or use a new --out"
        )
    return state


def write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write the metric rows (columns ``METRIC_FIELDS``) to ``path`` atomically."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in METRIC_FIELDS})
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics CSV, counts as ints and the rest as floats."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        out.append(
            {
                k: (int(v) if k in ("epoch", "step", "samples", "updates") else float(v))
                for k, v in r.items()
            }
        )
    return out


def write_state(out: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``out / STATE_FILE`` atomically."""
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, out / STATE_FILE)
