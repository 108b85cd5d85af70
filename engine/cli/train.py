"""``python -m engine train``: train a staged model on a bundled dataset with any schedule.

Why it looks like this: a user comparing pipeline methods needs the whole loop (data, model
split into stages, schedule, mitigations, evaluation, checkpoint, metrics) behind one command
whose options name the concepts of ALGORITHMS.md, and needs a run to be resumable and exactly
repeatable. This module holds the command's options and its entry point; the parts live
beside it, one concept each:

* ``engine.cli.config``: ``TrainConfig``, the hyper-parameter scaling rule behind ``--lr``,
  ``--momentum`` and ``--ref-batch`` (why ``--scaling per-sample`` is the default), and the
  option checks;
* ``engine.cli.loop``: building the pipeline, the epoch-structured training loop, evaluation;
* ``engine.cli.runlog``: the metrics CSV and the resume state in ``--out``;
* ``engine.cli.outdir``: one run per ``--out`` (an earlier run's files stop the command
  unless ``--resume`` or ``--overwrite``).

The names other modules import from here (``TrainConfig``, ``train``, ...) are re-exported.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from engine.cli import CLIError
from engine.cli.config import (
    OPTIMIZERS,
    PREDICTIONS,
    SCHEDULES,
    TASK_DEFAULTS,
    TASKS,
    TrainConfig,
    check_config,
    config_from_args,
)
from engine.cli.loop import TrainResult, train
from engine.runtime.setup.config import CHECKPOINT_MODES, DEFAULT_CHECKPOINT
from engine.cli.runlog import CHECKPOINT_FILE, METRICS_FILE

__all__ = [
    "TrainConfig",
    "TrainResult",
    "add_arguments",
    "add_model_arguments",
    "add_hparam_arguments",
    "run",
    "train",
    "config_from_args",
    "check_config",
]


def _positive(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


class _DeprecatedAlias(argparse.Action):
    """An old option name that still works, with a DeprecationWarning naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        new = "--recompute"
        msg = f"{option_string} is deprecated and will be removed in 0.3; use {new} {values}"
        warnings.warn(msg, DeprecationWarning, stacklevel=2)
        print(f"{parser.prog}: warning: {msg}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _per_task(option: str) -> str:
    """The per-task default of ``option`` as help text: "16; lm: 6"."""
    return "; ".join(
        f"{v[option]}" if t == "classify" else f"{t}: {v[option]}" for t, v in TASK_DEFAULTS.items()
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare``: data, model, optimizer, run length."""
    from engine.demo.data import DATASETS

    p.add_argument(
        "--task",
        choices=TASKS,
        default="classify",
        help="classify (default: residual MLP on --dataset) or lm (GPT-style decoder on the "
        "generated character corpus, engine/demo/corpus.py)",
    )
    p.add_argument(
        "--dataset", default="digits", help=f"one of {', '.join(DATASETS)} (default digits)"
    )
    p.add_argument(
        "--layers", type=_positive("--layers"), default=None,
        help=f"model layers L (default {_per_task('layers')})",
    )
    p.add_argument(
        "--width", type=_positive("--width"), default=None,
        help=f"hidden width (default {_per_task('width')})",
    )
    p.add_argument(
        "--batch-size",
        type=_positive("--batch-size"),
        default=1,
        help="samples per micro-batch (default 1)",
    )
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="sgd",
        help=f"stage optimizer, engine.optim's: {', '.join(OPTIMIZERS)} (default sgd)",
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.0,
        help="weight decay (default 0; decoupled for adamw, muon, basis-rotation)",
    )
    p.add_argument(
        "--recompute",
        dest="checkpoint",
        choices=CHECKPOINT_MODES,
        default=DEFAULT_CHECKPOINT,
        help=f"activation recomputation, engine.Pipeline's checkpoint= (default "
        f"{DEFAULT_CHECKPOINT}, as the API's: fastest; except_last/always re-run forwards in "
        "the backward: slower steps for less activation memory, README 'Activation "
        "recomputation')",
    )
    p.add_argument(
        "--checkpoint",
        dest="checkpoint",
        choices=CHECKPOINT_MODES,
        action=_DeprecatedAlias,
        help="deprecated alias of --recompute (removed in 0.3; not --checkpoint-every, "
        "which saves checkpoints)",
    )
    p.add_argument(
        "--epochs", type=_positive("--epochs"), default=3,
        help="passes over the training set (default 3)",
    )
    p.add_argument(
        "--evals-per-epoch",
        type=_positive("--evals-per-epoch"),
        default=4,
        help="test-set evaluations (metric rows) per epoch",
    )
    p.add_argument(
        "--seed", type=int, default=0,
        help="seed of the weights and the data order (default 0); a rerun repeats the bits",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--threads",
        type=_positive("--threads"),
        default=1,
        help="torch CPU threads (default 1: the stages' tensors are tiny, and extra "
        "threads only spin and contend on a shared machine)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def add_hparam_arguments(p: argparse.ArgumentParser) -> None:
    """--lr/--momentum/--ref-batch: reference values and the scaling rule (shared with compare)."""
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate for --ref-batch samples per update (default {_per_task('lr')})",
    )
    p.add_argument(
        "--momentum",
        type=float,
        default=0.9,
        help="momentum for --ref-batch samples per update (default 0.9)",
    )
    p.add_argument(
        "--ref-batch",
        type=_positive("--ref-batch"),
        default=32,
        help="reference samples per update B_ref (default 32): lr = lr*B/B_ref, "
        "m = m**(B/B_ref) for this run's B",
    )
    p.add_argument(
        "--scaling",
        choices=("per-sample", "linear"),
        default="per-sample",
        help="lr rule: per-sample (default: lr*B/B_ref*(1-m)/(1-m_ref), each sample's total "
        "step fixed) or linear (lr*B/B_ref as in ALGORITHMS.md; diverges at B=1)",
    )
    p.add_argument(
        "--stage-beta1",
        type=float,
        default=None,
        metavar="B",
        help="--optimizer nadam: AsyncPP's per-stage beta1, m + D_s (B - m) / S (e.g. 0.99)",
    )
    p.add_argument(
        "--delay-compensation",
        type=float,
        default=0.0,
        metavar="LAMBDA",
        help="DC-ASGD's lambda: g + lambda * g * g * (D_s * delta) with PipeMare's delta "
        "(pipedream, 2bw; pb with --discrepancy-correction). compare: the *+dc methods' "
        "lambda (default 0.04 there)",
    )
    p.add_argument(
        "--no-scaling",
        dest="ref_batch",
        action="store_const",
        const=None,
        help="use --lr and --momentum as given, whatever the update size",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--schedule", default="pb",
        help=f"one of {', '.join(SCHEDULES)} (default pb); auto: the fastest synchronous family "
        "whose predicted memory per rank fits --memory-cap (stage costs profiled once and kept "
        "in --out)",
    )
    p.add_argument(
        "--virtual-stages", type=_positive("--virtual-stages"), default=None,
        help="interleaved and looped_bfs: stages per rank v (default 2)",
    )
    p.add_argument(
        "--memory-cap", type=float, default=None, metavar="BYTES",
        help="--schedule auto: the most bytes a rank may hold (weights, gradients, optimizer "
        "state, saved activations)",
    )
    p.add_argument(
        "--stages", type=_positive("--stages"), default=None,
        help=f"pipeline stages S (default {_per_task('stages')})",
    )
    p.add_argument(
        "--chunks",
        type=_positive("--chunks"),
        default=8,
        help="micro-batches per step M (default 8)",
    )
    p.add_argument(
        "--update-size",
        type=_positive("--update-size"),
        default=None,
        help="micro-batches per optimizer step k (pb/pipedream; default 1; sync and 2bw: M)",
    )
    p.add_argument(
        "--order", choices=("dataflow", "1f1b"), default=None, help="pb only (default dataflow)"
    )
    add_hparam_arguments(p)
    p.add_argument("--spike-compensation", action="store_true", help="SC_D of Kosson et al.")
    p.add_argument(
        "--prediction",
        choices=PREDICTIONS,
        default=None,
        help="pb only: lwp (linear weight prediction), spectrain, spectrain_reuse",
    )
    p.add_argument(
        "--prediction-mode", choices=("linear", "momentum"), default="linear",
        help="how --prediction lwp extrapolates the weights D_s updates ahead: linear (from "
        "the last update, default) or momentum (from the momentum buffer)",
    )
    p.add_argument(
        "--pipemare-lr", action="store_true", help="PipeMare T1 learning-rate rescheduling"
    )
    p.add_argument(
        "--pipemare-warmup",
        type=int,
        default=None,
        help="T1 warm-up K in updates (default: one epoch of updates)",
    )
    p.add_argument("--discrepancy-correction", action="store_true", help="PipeMare T2")
    p.add_argument(
        "--correction-decay", type=float, default=0.1,
        help="PipeMare's D_decay in (0, 1) for --discrepancy-correction's delta (default 0.1)",
    )
    p.add_argument(
        "--out", default="out/train",
        help="folder for checkpoint, metrics.csv, train_state.json (default out/train); one "
        "run per folder: an earlier run's files there stop the command unless --resume or "
        "--overwrite",
    )
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument(
        "--overwrite", action="store_true",
        help="delete an earlier run's checkpoint, state and metrics in --out, then train anew",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_positive("--checkpoint-every"),
        default=None,
        help="also commit a checkpoint every N steps inside an epoch, so --resume continues "
        "mid-epoch (asynchronous schedules drain there: part of the run, fixed on --resume)",
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    overwrite = getattr(args, "overwrite", False)
    if cfg.resume and overwrite:
        raise CLIError("--resume continues the run in --out and --overwrite replaces it: pass one")
    res = train(cfg, overwrite=overwrite)
    lr, m = res.lr, res.momentum
    if res.diverged:
        print(
            f"python -m engine train: error: training diverged ({res.diverged}); lower --lr",
            file=sys.stderr,
        )
        return 1
    st = res.stats
    print(
        f"{cfg.label()} on {cfg.data_name}: S={cfg.stages} M={cfg.chunks} B/update={cfg.samples_per_update()} "
        f"lr={lr:.4g} momentum={m:.4g} delays={st.get('delays')}"
    )
    print(
        f"epochs={cfg.epochs} test_acc={res.final_test_acc:.4f} test_loss={res.final_test_loss:.4f} "
        f"samples/s={res.samples_per_s:.0f}"
    )
    if res.steps_run == 0:  # a --resume of a finished run: nothing was trained or written
        print(f"trained nothing; {Path(cfg.out) / CHECKPOINT_FILE} and "
              f"{Path(cfg.out) / METRICS_FILE} are unchanged")
    else:
        print(f"wrote {Path(cfg.out) / CHECKPOINT_FILE}, {Path(cfg.out) / METRICS_FILE}")
    return 0
