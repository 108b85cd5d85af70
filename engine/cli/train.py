"""``python -m engine train``: train a staged model on a bundled dataset with any schedule.

Why it looks like this: a user comparing pipeline methods needs the whole loop (data, model
split into stages, schedule, mitigations, evaluation, checkpoint, metrics) behind one command
whose options name the concepts of ALGORITHMS.md, and needs a run to be resumable and exactly
repeatable. Training is epoch-structured: every epoch ends with ``pipe.flush()`` (asynchronous
schedules drain, so the weights are well defined), a test evaluation, a checkpoint
(``engine.save``) and the metrics CSV. Because the data order of an epoch depends only on
(seed, epoch) and the checkpoint restores every weight, optimizer and scheduler state, a run
resumed with ``--resume`` produces the same weights and metrics as an uninterrupted one.

Hyper-parameters: ``--lr`` and ``--momentum`` are reference values for ``--ref-batch`` B_ref
samples per update (default 0.03 and 0.9 at B_ref = 32, the best of lr in {0.03, 0.1, 0.3}
for plain synchronous SGD on digits over 3 epochs) rescaled to this run's samples per update
B. The momentum follows Kosson et al.'s rule m = m_ref ** (B / B_ref) (the time constant in
samples stays fixed). For the learning rate, ``--scaling linear`` is the rule as ALGORITHMS.md
writes it, lr = lr_ref * B / B_ref; but with PyTorch's undampened momentum (v = m v + g,
which the engine uses) and mean-reduced losses, a sample's gradient then moves the weights by
lr / (B (1 - m)) in total, which grows like B_ref / B as B shrinks (32x at B = 1), and
synchronous SGD at B = 1 diverges on digits with it (measured). The default
``--scaling per-sample`` multiplies that lr by (1 - m) / (1 - m_ref), which keeps each
sample's total contribution fixed: it is the linear rule written for the dampened (EMA)
momentum convention, translated to PyTorch's. ``--no-scaling`` uses --lr/--momentum as given.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.cli import CLIError

__all__ = ["TrainConfig", "TrainResult", "add_arguments", "run", "train", "config_from_args"]

SCHEDULES = ("naive", "gpipe", "1f1b", "pipedream", "2bw", "pb")
PREDICTIONS = ("lwp", "spectrain", "spectrain_reuse")
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


@dataclass
class TrainConfig:
    """Everything that determines a training run (saved next to the checkpoint)."""

    dataset: str = "digits"
    schedule: str = "pb"
    stages: int = 8
    layers: int = 16
    width: int = 64
    chunks: int = 8
    batch_size: int = 1
    update_size: int | None = None
    order: str | None = None
    optimizer: str = "sgd"
    lr: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 0.0
    ref_batch: int | None = 32
    scaling: str = "per-sample"
    spike_compensation: bool = False
    prediction: str | None = None
    prediction_mode: str = "linear"
    pipemare_lr: bool = False
    pipemare_warmup: int | None = None
    discrepancy_correction: bool = False
    correction_decay: float = 0.1
    checkpoint: str = "never"
    epochs: int = 3
    evals_per_epoch: int = 4
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    out: str = "out/train"
    resume: bool = False
    progress: bool = True

    # ------------------------------------------------------------ derived quantities

    def samples_per_update(self) -> int:
        """B: samples whose gradients one optimizer step applies."""
        if self.schedule in ("naive", "gpipe", "1f1b", "2bw"):
            k = self.chunks
        else:
            k = self.update_size or 1
        return k * self.batch_size

    def effective_hparams(self) -> tuple[float, float]:
        """(lr, momentum) after the scaling rule when ``ref_batch`` is set."""
        if self.ref_batch is None:
            return self.lr, self.momentum
        ratio = self.samples_per_update() / self.ref_batch
        m = self.momentum**ratio
        lr = self.lr * ratio
        if self.scaling == "per-sample" and self.momentum > 0:
            # PyTorch's undampened momentum: a sample's gradient moves w by lr / (B (1 - m)) in
            # total; keep that fixed (equivalently, the rule in the dampened EMA convention).
            lr *= (1 - m) / (1 - self.momentum)
        return lr, m

    def label(self) -> str:
        parts = [self.schedule]
        if self.spike_compensation:
            parts.append("SC")
        if self.prediction:
            parts.append(self.prediction.upper() if self.prediction == "lwp" else self.prediction)
        if self.pipemare_lr:
            parts.append("T1")
        if self.discrepancy_correction:
            parts.append("T2")
        return "+".join(parts)


@dataclass
class TrainResult:
    """What a finished (or diverged) run reports back to ``compare``."""

    config: TrainConfig
    rows: list[dict[str, Any]] = field(default_factory=list)
    final_test_acc: float = float("nan")
    final_test_loss: float = float("nan")
    samples_per_s: float = float("nan")
    train_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    diverged: str | None = None
    stage_param_bytes: list[int] = field(default_factory=list)
    stage_activation_bytes: list[int] = field(default_factory=list)
    lr: float = float("nan")
    momentum: float = float("nan")


# ------------------------------------------------------------------ argument parsing


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


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare``: data, model, optimizer, run length."""
    from engine.data import DATASETS

    p.add_argument(
        "--dataset", default="digits", help=f"one of {', '.join(DATASETS)} (default digits)"
    )
    p.add_argument(
        "--layers", type=_positive("--layers"), default=16, help="model layers L (default 16)"
    )
    p.add_argument(
        "--width", type=_positive("--width"), default=64, help="hidden width (default 64)"
    )
    p.add_argument(
        "--batch-size",
        type=_positive("--batch-size"),
        default=1,
        help="samples per micro-batch (default 1)",
    )
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--checkpoint",
        choices=("never", "except_last", "always"),
        default="never",
        help="activation recomputation (default never: the models are small)",
    )
    p.add_argument("--epochs", type=_positive("--epochs"), default=3)
    p.add_argument(
        "--evals-per-epoch",
        type=_positive("--evals-per-epoch"),
        default=4,
        help="test-set evaluations (metric rows) per epoch",
    )
    p.add_argument("--seed", type=int, default=0)
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
        default=0.03,
        help="learning rate for --ref-batch samples per update (default 0.03)",
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
        "--no-scaling",
        dest="ref_batch",
        action="store_const",
        const=None,
        help="use --lr and --momentum as given, whatever the update size",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--schedule", default="pb", help=f"one of {', '.join(SCHEDULES)} (default pb)")
    p.add_argument(
        "--stages", type=_positive("--stages"), default=8, help="pipeline stages S (default 8)"
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
    p.add_argument("--prediction-mode", choices=("linear", "momentum"), default="linear")
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
    p.add_argument("--correction-decay", type=float, default=0.1)
    p.add_argument(
        "--out", default="out/train", help="folder for checkpoint, metrics.csv, train_state.json"
    )
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f for f in TrainConfig.__dataclass_fields__}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def check_config(cfg: TrainConfig) -> None:
    """Reject bad settings with a message that names the option and the fix (before any work)."""
    from engine.data import DATASETS
    from engine.models import ModelError, even_balance

    if cfg.dataset not in DATASETS:
        raise CLIError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}")
    if cfg.schedule not in SCHEDULES:
        raise CLIError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    try:
        even_balance(cfg.layers, cfg.stages)
    except ModelError as exc:
        raise CLIError(str(exc)) from None
    if cfg.device not in ("cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise CLIError(f"--device {cfg.device!r}; use cpu or cuda")
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CLIError(
                f"--device {cfg.device} but no CUDA GPU is visible to torch; use --device cpu"
            )
    if not cfg.lr > 0 or not math.isfinite(cfg.lr):
        raise CLIError(f"--lr {cfg.lr} must be a positive number")
    if not 0 <= cfg.momentum < 1:
        raise CLIError(f"--momentum {cfg.momentum} must lie in [0, 1)")
    if cfg.schedule != "pb":
        for flag, on in (
            ("--prediction", cfg.prediction is not None),
            ("--discrepancy-correction", cfg.discrepancy_correction),
            ("--order", cfg.order is not None),
        ):
            if on:
                raise CLIError(
                    f"{flag} applies to --schedule pb only (got --schedule {cfg.schedule})"
                )
    if cfg.pipemare_warmup is not None and cfg.pipemare_warmup < 0:
        raise CLIError(f"--pipemare-warmup {cfg.pipemare_warmup} must be >= 0")
    if cfg.prediction is not None and cfg.momentum == 0 and cfg.optimizer == "sgd":
        raise CLIError("--prediction extrapolates the momentum buffer; it needs --momentum > 0")


# ------------------------------------------------------------------ building the run


class _AccuracyLoss:
    """Cross-entropy that also counts correct predictions of the training forwards.

    ``Pipeline.step`` returns only the loss; the last stage's logits reach us through the loss
    function, so counting here gives the training accuracy of exactly the micro-batches trained
    on. Calls without grad (the pipeline's one-off shape check) are not counted.
    """

    def __init__(self) -> None:
        self.correct = 0
        self.seen = 0

    def __call__(self, out: Any, target: Any) -> Any:
        import torch

        if torch.is_grad_enabled():
            with torch.no_grad():
                self.correct += int((out.argmax(dim=1) == target).sum())
                self.seen += int(target.numel())
        return torch.nn.functional.cross_entropy(out, target)

    def take(self) -> float:
        acc = self.correct / self.seen if self.seen else float("nan")
        self.correct = self.seen = 0
        return acc


def _steps_per_epoch(cfg: TrainConfig, n_train: int) -> int:
    per_step = cfg.chunks * cfg.batch_size
    steps = n_train // per_step
    if steps < 1:
        raise CLIError(
            f"one step needs --chunks x --batch-size = {per_step} samples but the training set has "
            f"{n_train}; lower --chunks or --batch-size"
        )
    return steps


def build_pipeline(
    cfg: TrainConfig, num_features: int, num_classes: int, updates_per_epoch: int
) -> tuple[Any, list[Any], _AccuracyLoss]:
    """(pipeline, stage modules, loss) for ``cfg``; the stage modules stay usable for eval."""
    import torch

    import engine
    from engine.models import even_balance, residual_mlp

    torch.manual_seed(cfg.seed)
    seq = residual_mlp(num_features, num_classes, cfg.layers, cfg.width).to(cfg.device)
    balance = even_balance(cfg.layers, cfg.stages)
    layers = list(seq.children())
    modules: list[torch.nn.Module] = []
    i = 0
    for b in balance:
        modules.append(torch.nn.Sequential(*layers[i : i + b]))
        i += b
    lr, momentum = cfg.effective_hparams()
    opt_kwargs: dict[str, Any] = {
        "spike_compensation": cfg.spike_compensation,
        "prediction": cfg.prediction_mode if cfg.prediction else None,
        "discrepancy_correction": cfg.discrepancy_correction,
        "correction_decay": cfg.correction_decay,
        "weight_decay": cfg.weight_decay,
    }

    def make_optimizer(params: list[Any]) -> torch.optim.Optimizer:
        if cfg.optimizer == "adam":
            return engine.optim.Adam(params, lr=lr, betas=(momentum, 0.999), **opt_kwargs)
        return engine.optim.SGD(params, lr=lr, momentum=momentum, **opt_kwargs)

    scheduler = None
    if cfg.pipemare_lr:
        warm = cfg.pipemare_warmup if cfg.pipemare_warmup is not None else updates_per_epoch

        def scheduler(o: torch.optim.Optimizer) -> Any:
            return engine.optim.PipeMareLR(o, warm)

    loss = _AccuracyLoss()
    pipe = engine.Pipeline(
        modules,
        schedule=cfg.schedule,
        chunks=cfg.chunks,
        loss_fn=loss,
        optimizer=make_optimizer,
        checkpoint=cfg.checkpoint,
        update_size=cfg.update_size if cfg.schedule in ("pb", "pipedream") else None,
        order=cfg.order,
        prediction=cfg.prediction,
        discrepancy_correction=cfg.discrepancy_correction or None,
        correction_decay=cfg.correction_decay,
        lr_scheduler=scheduler,
    )
    return pipe, modules, loss


def activation_bytes(modules: list[Any], x: Any) -> list[int]:
    """Bytes one micro-batch ``x`` leaves stashed at each stage between its F and its B.

    Measured, not modelled: the stage input (the pipeline stashes it) plus every tensor autograd
    saves for the backward (via ``saved_tensors_hooks``), parameters excluded (they are weight
    memory). With activation recomputation only the input would stay; the CLI's default
    ``--checkpoint never`` keeps everything, which is what this counts.
    """
    import torch

    out = []
    h = x
    for m in modules:
        params = {p.data_ptr() for p in m.parameters()}
        saved: dict[int, int] = {}

        def pack(
            t: torch.Tensor, params: set[int] = params, saved: dict[int, int] = saved
        ) -> torch.Tensor:
            if t.data_ptr() not in params:
                saved[t.data_ptr()] = t.numel() * t.element_size()
            return t

        inp = h.detach().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = m(inp)
        saved.pop(inp.data_ptr(), None)
        out.append(inp.numel() * inp.element_size() + sum(saved.values()))
        h = h.detach()
    return out


def evaluate(modules: list[Any], x: Any, y: Any) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the stages run in sequence on (x, y), no grad."""
    import torch

    modes = [m.training for m in modules]
    try:
        with torch.no_grad():
            h = x
            for m in modules:
                m.eval()
                h = m(h)
            loss = float(torch.nn.functional.cross_entropy(h, y))
            acc = float((h.argmax(dim=1) == y).float().mean())
    finally:
        for m, t in zip(modules, modes, strict=True):
            m.train(t)
    return loss, acc


# ------------------------------------------------------------------ resume bookkeeping


def _resume_key(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in asdict(cfg).items() if k not in _RESUME_FREE}


def _read_state(out: Path, cfg: TrainConfig) -> dict[str, Any]:
    state_path = out / STATE_FILE
    if not state_path.exists() or not (out / CHECKPOINT_FILE).exists():
        raise CLIError(
            f"--resume: no checkpoint in {out} (expected {CHECKPOINT_FILE} and {STATE_FILE}); "
            "run without --resume first, or point --out at the earlier run"
        )
    state = json.loads(state_path.read_text())
    saved = state["config"]
    mine = _resume_key(cfg)
    diff = [
        f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in mine.items() if saved.get(k) != v
    ]
    if diff:
        raise CLIError(
            f"--resume: the run in {out} used different options ({'; '.join(diff)}); "
            "repeat its options (only --epochs may grow) or use a new --out"
        )
    return state


def _write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in METRIC_FIELDS})
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
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


# ------------------------------------------------------------------ the loop


def train(
    cfg: TrainConfig, *, save: bool = True, desc: str | None = None, position: int | None = None
) -> TrainResult:
    """Run ``cfg`` to ``cfg.epochs`` epochs; with ``save`` write checkpoint, state and CSV to ``cfg.out``.

    A non-finite loss ends the run early with ``result.diverged`` set (no exception), so that
    a comparison records the divergence instead of aborting.
    """
    import torch
    from tqdm import tqdm

    import engine
    from engine.data import epoch_order, load_dataset

    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    data = load_dataset(cfg.dataset).to(cfg.device)
    steps_per_epoch = _steps_per_epoch(cfg, len(data.train_y))
    mbs_per_epoch = steps_per_epoch * cfg.chunks
    updates_per_epoch = max(1, mbs_per_epoch * cfg.batch_size // cfg.samples_per_update())
    try:
        pipe, modules, loss_fn = build_pipeline(
            cfg, data.num_features, data.num_classes, updates_per_epoch
        )
    except ValueError as exc:  # PipelineConfigError: an invalid option combination
        raise CLIError(str(exc)) from None
    lr, momentum = cfg.effective_hparams()
    result = TrainResult(cfg, lr=lr, momentum=momentum)
    result.stage_param_bytes = [
        sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules
    ]
    result.stage_activation_bytes = activation_bytes(modules, data.train_x[: cfg.batch_size])
    out = Path(cfg.out)
    start_epoch = 0
    samples = 0
    train_seconds = 0.0
    if cfg.resume:
        state = _read_state(out, cfg)
        try:
            engine.load(pipe, out / CHECKPOINT_FILE)
        except ValueError as exc:
            raise CLIError(f"--resume: {exc}") from None
        start_epoch = int(state["epoch"])
        samples = int(state["samples"])
        train_seconds = float(state["train_seconds"])
        if (out / METRICS_FILE).exists():
            result.rows = [r for r in read_metrics(out / METRICS_FILE) if r["epoch"] <= start_epoch]
    if save:
        out.mkdir(parents=True, exist_ok=True)

    per_step = cfg.chunks * cfg.batch_size
    evals = min(cfg.evals_per_epoch, steps_per_epoch)
    log_steps = {round((i + 1) * steps_per_epoch / evals) - 1 for i in range(evals)}
    n_train = len(data.train_y)
    stats_mark = None
    bar = tqdm(
        total=cfg.epochs * steps_per_epoch * per_step,
        initial=start_epoch * steps_per_epoch * per_step,
        desc=desc or cfg.label(),
        unit="sample",
        disable=not cfg.progress,
        leave=position is None,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    loss_sum, loss_n = 0.0, 0
    try:
        for epoch in range(start_epoch, cfg.epochs):
            order = epoch_order(n_train, cfg.seed, epoch).to(data.train_x.device)
            t0 = time.perf_counter()
            seg_samples = 0
            for step in range(steps_per_epoch):
                idx = order[step * per_step : (step + 1) * per_step]
                try:
                    loss = pipe.step(data.train_x[idx], data.train_y[idx])
                except FloatingPointError as exc:  # NonFiniteLossError
                    result.diverged = f"epoch {epoch + 1} step {step + 1}: {exc}"
                    raise
                lv = float(loss)
                if not math.isfinite(lv):
                    result.diverged = f"epoch {epoch + 1} step {step + 1}: loss {lv}"
                    raise FloatingPointError(result.diverged)
                loss_sum += lv * per_step
                loss_n += per_step
                samples += per_step
                seg_samples += per_step
                bar.update(per_step)
                last = step == steps_per_epoch - 1
                if step in log_steps:
                    if last:
                        pipe.flush()
                    seg_t = time.perf_counter() - t0
                    train_seconds += seg_t
                    test_loss, test_acc = evaluate(modules, data.test_x, data.test_y)
                    st = pipe.stats()
                    row = {
                        "epoch": epoch + 1,
                        "step": epoch * steps_per_epoch + step + 1,
                        "samples": samples,
                        "updates": max(st["updates"]),
                        "train_loss": loss_sum / max(loss_n, 1),
                        "train_acc": loss_fn.take(),
                        "test_loss": test_loss,
                        "test_acc": test_acc,
                        "samples_per_s": seg_samples / seg_t if seg_t > 0 else float("nan"),
                        "elapsed_s": train_seconds,
                    }
                    result.rows.append(row)
                    loss_sum, loss_n, seg_samples = 0.0, 0, 0
                    bar.set_postfix(
                        loss=f"{row['train_loss']:.3f}",
                        acc=f"{row['train_acc']:.3f}",
                        test=f"{test_acc:.3f}",
                        sps=f"{row['samples_per_s']:.0f}",
                    )
                    t0 = time.perf_counter()
            if save:
                engine.save(pipe, out / CHECKPOINT_FILE)
                _write_metrics(out / METRICS_FILE, result.rows)
                state = {
                    "config": _resume_key(cfg),
                    "epoch": epoch + 1,
                    "samples": samples,
                    "train_seconds": train_seconds,
                    "lr": lr,
                    "momentum": momentum,
                }
                tmp = out / (STATE_FILE + ".tmp")
                tmp.write_text(json.dumps(state, indent=1))
                os.replace(tmp, out / STATE_FILE)
            stats_mark = pipe.stats()
    except FloatingPointError as exc:
        result.diverged = result.diverged or str(exc)
    finally:
        bar.close()
    if result.rows:
        result.final_test_acc = result.rows[-1]["test_acc"]
        result.final_test_loss = result.rows[-1]["test_loss"]
    result.train_seconds = train_seconds
    result.samples_per_s = samples / train_seconds if train_seconds > 0 else float("nan")
    result.stats = stats_mark if stats_mark is not None else _safe_stats(pipe)
    if save and result.rows:
        _write_metrics(out / METRICS_FILE, result.rows)
    return result


def _safe_stats(pipe: Any) -> dict[str, Any]:
    try:
        return pipe.stats()
    except Exception:  # stats of a pipeline that diverged mid-flight are best-effort
        return {}


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    res = train(cfg)
    lr, m = res.lr, res.momentum
    if res.diverged:
        print(
            f"python -m engine train: error: training diverged ({res.diverged}); lower --lr",
            file=sys.stderr,
        )
        return 1
    st = res.stats
    print(
        f"{cfg.label()} on {cfg.dataset}: S={cfg.stages} M={cfg.chunks} B/update={cfg.samples_per_update()} "
        f"lr={lr:.4g} momentum={m:.4g} delays={st.get('delays')}"
    )
    print(
        f"epochs={cfg.epochs} test_acc={res.final_test_acc:.4f} test_loss={res.final_test_loss:.4f} "
        f"samples/s={res.samples_per_s:.0f}"
    )
    print(f"wrote {Path(cfg.out) / CHECKPOINT_FILE}, {Path(cfg.out) / METRICS_FILE}")
    return 0
