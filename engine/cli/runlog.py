"""What a run leaves in ``--out``: the metrics CSV, the resume state, and how both are written.

Why: ``--resume`` must continue exactly where an earlier run stopped, and only with the same
options; so ``train_state.json`` records the configuration (minus the options that may change
between a run and its resumption, e.g. ``--epochs``) beside the epoch, sample count and
training time (after a ``--checkpoint-every`` commit also the loop's position inside the
epoch, see ``loop``), and a resumed run is refused with the differing options named -- except
``--stages``: the loop commits flushed checkpoints, and ``engine.load`` moves a flushed
checkpoint to another stage count by the model's layer names. Every file is
written to a temporary name and moved into place with ``os.replace``. The checkpoint and the
state are one unit (:func:`commit_epoch`): the state records the checkpoint's SHA-256, so a
crash between their two renames is detected on resume and finished from the ``.next`` file,
never resumed from a state that does not belong to the weights (which trained an epoch twice).
A full disk or a read-only folder fails with one line and leaves the previous unit intact.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.cli import CLIError, CLIFailure
from engine.cli.config import TrainConfig
from engine.serialization import file_sha256

__all__ = [
    "CHECKPOINT_FILE",
    "STATE_FILE",
    "METRICS_FILE",
    "METRIC_FIELDS",
    "RUN_OUTPUTS",
    "resume_key",
    "read_state",
    "commit_epoch",
    "write_metrics",
    "read_metrics",
]

CHECKPOINT_FILE = "checkpoint.safetensors"
STATE_FILE = "train_state.json"
#: --schedule auto: the stage costs it chose from, reused by a resumed run
STAGE_COSTS_FILE = "stage_costs.json"
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
#: what a run writes in --out (the ``.next`` files while it commits an epoch): another run
#: starting in that folder without --resume is refused (engine/cli/outdir.py)
RUN_OUTPUTS = (CHECKPOINT_FILE, STATE_FILE, METRICS_FILE, CHECKPOINT_FILE + ".next",
               STATE_FILE + ".next")
#: config fields that may differ between a run and its resumption
_RESUME_FREE = {"epochs", "progress", "out", "resume", "device", "threads"}


def resume_key(cfg: TrainConfig) -> dict[str, Any]:
    """The options a resumption must repeat (saved in, and compared with, the state file)."""
    return {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE}


def _json(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
            raise ValueError("not a train state")
        return state
    except (OSError, ValueError) as exc:
        raise CLIFailure(
            f"--resume: {path} is unreadable ({exc}); the checkpoint beside it is untouched: "
            "restore the file, or start a new --out"
        ) from None


def commit_epoch(out: Path, pipe: Any, state: dict[str, Any]) -> None:
    """Write the checkpoint and the train state as one unit (module docstring): both go to
    ``.next`` files first, then the checkpoint and the state are renamed into place; a resume
    that finds a new checkpoint beside an old state completes the commit from ``.next``."""
    import engine

    ckpt_next = out / (CHECKPOINT_FILE + ".next")
    state_next = out / (STATE_FILE + ".next")
    try:
        engine.save(pipe, ckpt_next)
        state = dict(state, checkpoint_sha256=file_sha256(ckpt_next))
        tmp = out / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, state_next)
        os.replace(ckpt_next, out / CHECKPOINT_FILE)
        os.replace(state_next, out / STATE_FILE)
    except OSError as exc:
        for leftover in (ckpt_next, out / (STATE_FILE + ".tmp")):
            with contextlib.suppress(OSError):
                leftover.unlink()
        raise CLIFailure(
            f"cannot write the checkpoint to {out}: {exc.strerror or exc}; the previous "
            "checkpoint and train state are intact (--resume continues from them)"
        ) from None


def read_state(out: Path, cfg: TrainConfig) -> dict[str, Any]:
    """The state of the run in ``out``, after checking that ``cfg`` may resume it."""
    state_path = out / STATE_FILE
    if not state_path.exists() or not (out / CHECKPOINT_FILE).exists():
        raise CLIError(
            f"--resume: no checkpoint in {out} (expected {CHECKPOINT_FILE} and {STATE_FILE}); "
            "run without --resume first, or point --out at the earlier run"
        )
    state = _json(state_path)
    want = state.get("checkpoint_sha256")
    have = file_sha256(out / CHECKPOINT_FILE) if want is not None else None
    if have != want:
        pending = out / (STATE_FILE + ".next")
        nxt = _json(pending) if pending.exists() else None
        if nxt is None or nxt.get("checkpoint_sha256") != have:
            raise CLIFailure(
                f"--resume: {CHECKPOINT_FILE} in {out} is not the checkpoint {STATE_FILE} "
                "names (written by another run, or edited); start a new --out"
            )
        os.replace(pending, state_path)  # the crash came between the two renames: finish it
        state = nxt
    saved = state["config"]
    mine = resume_key(cfg)
    moves = _moves(out / CHECKPOINT_FILE) if saved.get("stages") != mine.get("stages") else set()
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in mine.items()
        if saved.get(k) != v and k not in moves
    ]
    if diff:
        raise CLIError(
            f"--resume: the run in {out} used different options ({'; '.join(diff)}); "
            "repeat its options (only --epochs may grow, and --stages when the checkpoint "
            "holds nothing in flight) or use a new --out"
        )
    return state


def _moves(checkpoint: Path) -> set[str]:
    """Options a resumption may change because ``engine.load`` moves the checkpoint to the
    new layout: ``stages``, when it was saved flushed (the loop's commits are)."""
    from engine.checkpoint_index import in_flight
    from engine.errors import CheckpointError

    try:
        return set() if in_flight(checkpoint) else {"stages"}
    except CheckpointError:
        return set()  # (the load names what is wrong with it)


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
