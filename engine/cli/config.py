"""The training configuration: ``TrainConfig``, its hyper-parameter scaling rule, and its checks.

Why a dataclass of plain values: a run is exactly repeatable and resumable only if everything
that determines it is one record, saved next to the checkpoint (``runlog``) and compared on
``--resume``; ``compare`` derives each method's record from one base with ``replace``.

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

Tasks: ``--task classify`` (default) trains the residual MLP on ``--dataset``;
``--task lm`` trains the GPT-style decoder of ``engine.demo.models.gpt`` on the generated corpus
(``engine.demo.data.load_lm_dataset``). ``--layers``, ``--width``, ``--stages`` and ``--lr`` default
per task (:data:`TASK_DEFAULTS`); an option given on the command line always wins.

Only the standard library is imported at module level, so ``python -m engine --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from engine.cli import CLIError
from engine.mitigations import WEIGHT_PREDICTIONS
from engine.schedule.auto import AUTO_FACTS
from engine.schedule.catalog import NAMES, ROWS, Family, family, unknown_schedule
from engine.runtime.setup.config import DEFAULT_CHECKPOINT

__all__ = [
    "SCHEDULES",
    "schedule_facts",
    "PREDICTIONS",
    "TASKS",
    "TASK_DEFAULTS",
    "TrainConfig",
    "config_from_args",
    "check_config",
]

#: every schedule family of the catalog, in its order (a new family is trainable from the command
#: line), then 'auto': the fastest synchronous family whose predicted memory fits --memory-cap
SCHEDULES: tuple[str, ...] = NAMES + (AUTO_FACTS.name,)


def schedule_facts(name: str) -> Family:
    """The catalog row of ``name``; for 'auto', the facts every synchronous choice shares."""
    return AUTO_FACTS if name == AUTO_FACTS.name else family(name)
#: --prediction's choices: the pipeline's weight predictions (engine.mitigations)
PREDICTIONS: tuple[str, ...] = WEIGHT_PREDICTIONS
OPTIMIZERS = ("sgd", "adam", "adamw", "nadam", "muon", "basis-rotation")
TASKS = ("classify", "lm")

#: per-task defaults of the options whose parser default is None (the command line wins)
TASK_DEFAULTS: dict[str, dict[str, int | float]] = {
    "classify": {"layers": 16, "width": 64, "stages": 8, "lr": 0.03},
    "lm": {"layers": 4, "width": 32, "stages": 4, "lr": 0.3},
}


@dataclass
class TrainConfig:
    """Everything that determines a training run (saved next to the checkpoint)."""

    task: str = "classify"
    dataset: str = "digits"
    schedule: str = "pb"
    stages: int = 8
    layers: int = 16
    width: int = 64
    chunks: int = 8
    batch_size: int = 1
    update_size: int | None = None
    order: str | None = None
    virtual_stages: int | None = None
    memory_cap: float | None = None
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
    stage_beta1: float | None = None
    delay_compensation: float = 0.0
    checkpoint: str = DEFAULT_CHECKPOINT  # activation recomputation (--recompute), the API's default
    epochs: int = 3
    evals_per_epoch: int = 4
    checkpoint_every: int | None = None
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    out: str = "out/train"
    resume: bool = False
    progress: bool = True

    # ------------------------------------------------------------ derived quantities

    def samples_per_update(self) -> int:
        """B: samples whose gradients one optimizer step applies."""
        if schedule_facts(self.schedule).per_minibatch:
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

    @property
    def data_name(self) -> str:
        """What the run trains on: the dataset, or "lm" (the generated corpus)."""
        return "lm" if self.task == "lm" else self.dataset

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
        if self.stage_beta1 is not None:
            parts.append(f"b1s{self.stage_beta1:g}")
        if self.delay_compensation:
            parts.append(f"DC{self.delay_compensation:g}")
        return "+".join(parts)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed options; other attributes (compare's own options) are ignored."""
    names = {f for f in TrainConfig.__dataclass_fields__}
    per_task = TASK_DEFAULTS["classify"].keys()
    given = {
        k: v for k, v in vars(args).items() if k in names and not (v is None and k in per_task)
    }
    task = given.get("task", "classify")
    if task not in TASK_DEFAULTS:
        raise CLIError(f"unknown --task {task!r}; choose one of {', '.join(TASKS)}")
    return TrainConfig(**{**TASK_DEFAULTS[task], **given})


def check_config(cfg: TrainConfig) -> None:
    """Reject bad settings with a message that names the option and the fix (before any work)."""
    from engine.demo.data import DATASETS
    from engine.demo.models import ModelError, even_balance

    if cfg.task not in TASKS:
        raise CLIError(f"unknown --task {cfg.task!r}; choose one of {', '.join(TASKS)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise CLIError(f"unknown --optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.task == "lm" and cfg.dataset != "digits":
        raise CLIError(
            f"--dataset {cfg.dataset} applies to --task classify; --task lm trains on the "
            "generated corpus (engine/demo/corpus.py)"
        )
    if cfg.dataset not in DATASETS:
        raise CLIError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(DATASETS)}")
    if cfg.schedule not in SCHEDULES:
        raise CLIError(unknown_schedule(cfg.schedule, also=(AUTO_FACTS.name,)))
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
    for flag, on, applies in (
        ("--prediction", cfg.prediction is not None, _live_async),
        ("--discrepancy-correction", cfg.discrepancy_correction, _live_async),
        ("--order", cfg.order is not None, _chooses_order),
        ("--update-size", cfg.update_size is not None, _free_update_size),
    ):
        if on and not applies(schedule_facts(cfg.schedule)):
            names = " and ".join(f.name for f in ROWS if applies(f))
            why = (
                f", which updates once per {cfg.chunks} --chunks micro-batches"
                if applies is _free_update_size
                else ""
            )
            raise CLIError(
                f"{flag} applies to --schedule {names} only (got --schedule {cfg.schedule}{why})"
            )
    row = schedule_facts(cfg.schedule)
    if cfg.virtual_stages is not None and not row.takes_virtual_stages:
        takes = " and ".join(f.name for f in ROWS if f.takes_virtual_stages)
        raise CLIError(f"--virtual-stages applies to --schedule {takes} only (got --schedule "
                       f"{cfg.schedule})")
    if cfg.memory_cap is not None:
        if row is not AUTO_FACTS:
            raise CLIError(f"--memory-cap applies to --schedule auto only (got --schedule {cfg.schedule})")
        if not (math.isfinite(cfg.memory_cap) and cfg.memory_cap > 0):
            raise CLIError(f"--memory-cap {cfg.memory_cap} must be a positive number of bytes")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        raise CLIError(f"--checkpoint-every {cfg.checkpoint_every} must be >= 1 (steps)")
    if cfg.pipemare_warmup is not None and cfg.pipemare_warmup < 0:
        raise CLIError(f"--pipemare-warmup {cfg.pipemare_warmup} must be >= 0")
    _check_nadam(cfg)
    _check_basis_rotation(cfg)
    _check_delay_compensation(cfg)
    if cfg.prediction is not None and cfg.momentum == 0 and cfg.optimizer == "sgd":
        raise CLIError("--prediction extrapolates the momentum buffer; it needs --momentum > 0")


def _live_async(fam: Family) -> bool:
    return fam.live_async  # the weight mitigations apply


def _chooses_order(fam: Family) -> bool:
    return len(fam.orders) > 1


def _free_update_size(fam: Family) -> bool:
    return not fam.per_minibatch  # any k >= 1, not k = M


def _check_delay_compensation(cfg: TrainConfig) -> None:
    """--delay-compensation (the pipeline refuses the same, in its words): DC-ASGD's lambda,
    for schedules whose gradients lag the weights (ALGORITHMS.md)."""
    lam = cfg.delay_compensation
    if not (math.isfinite(lam) and lam >= 0):
        raise CLIError(f"--delay-compensation {lam} must be a finite number >= 0 (0: off)")
    if not lam:
        return
    if schedule_facts(cfg.schedule).synchronous:
        raise CLIError(f"--delay-compensation compensates delayed gradients; --schedule "
                       f"{cfg.schedule} has no delay (use {', '.join(f.name for f in ROWS if not f.synchronous)})")
    if cfg.optimizer == "muon":
        raise CLIError("--delay-compensation applies to --optimizer sgd, adam, adamw and nadam; "
                       "engine.optim.Muon has no delay compensation (its gradient is "
                       "orthogonalised after momentum, which the correction's derivation does not cover)")
    if schedule_facts(cfg.schedule).live_async and not cfg.discrepancy_correction:
        raise CLIError("--delay-compensation with --schedule pb needs --discrepancy-correction "
                       "(PipeMare T2's backward weights give the gradient the lag it removes)")


def _check_nadam(cfg: TrainConfig) -> None:
    """NAdam's and Muon's options (their optimizers refuse the same, in their own words)."""
    if cfg.stage_beta1 is not None:
        if cfg.optimizer != "nadam":
            raise CLIError(f"--stage-beta1 applies to --optimizer nadam (got --optimizer {cfg.optimizer})")
        m = cfg.effective_hparams()[1]  # the beta1 the optimizer gets (after --ref-batch scaling)
        if not m <= cfg.stage_beta1 < 1:
            raise CLIError(
                f"--stage-beta1 {cfg.stage_beta1} must lie in [beta1, 1), beta1 = {m:.4g} (the "
                "--momentum after the --ref-batch rule; --no-scaling keeps --momentum as given)"
            )
    if cfg.optimizer == "nadam":
        if cfg.spike_compensation:
            raise CLIError("--spike-compensation does not apply to --optimizer nadam: its numerator "
                           "already is the look-ahead (use --optimizer adam for SC_D)")
        if cfg.prediction is not None and cfg.prediction_mode != "linear":
            raise CLIError("--optimizer nadam predicts with --prediction-mode linear only")
    if cfg.optimizer == "muon":  # engine.optim.Muon refuses the same
        if cfg.spike_compensation:
            raise CLIError("--spike-compensation does not apply to --optimizer muon: its update is "
                           "orthogonalised, not linear in the momentum (use --optimizer sgd or adam)")
        if cfg.prediction is not None and cfg.prediction_mode != "linear":
            raise CLIError("--optimizer muon predicts with --prediction-mode linear only")


def _check_basis_rotation(cfg: TrainConfig) -> None:
    """Basis rotation is the paper's method alone: it keeps no last step to predict from, no
    delta and no spike term (docs/ALGORITHMS.md, "Basis rotation")."""
    if cfg.optimizer != "basis-rotation":
        return
    for flag, on in (
        ("--spike-compensation", cfg.spike_compensation),
        ("--prediction", cfg.prediction is not None),
        ("--discrepancy-correction", cfg.discrepancy_correction),
        ("--pipemare-lr", cfg.pipemare_lr),
        ("--delay-compensation", bool(cfg.delay_compensation)),
    ):
        if on:
            raise CLIError(f"{flag} does not apply to --optimizer basis-rotation: it takes none of "
                           "the engine's delay mitigations (use --optimizer adam/adamw for them)")
