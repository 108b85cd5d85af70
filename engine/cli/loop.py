"""The training loop behind ``train`` and ``compare``: build the pipeline, train, evaluate.

Why it looks like this: training is epoch-structured. Every epoch ends with ``pipe.flush()``
(asynchronous schedules drain, so the weights are well defined), a test evaluation, a
checkpoint (``engine.save``) and the metrics CSV (``runlog``). Because the data order of an
epoch depends only on (seed, epoch) and the checkpoint restores every weight, optimizer and
scheduler state, a run resumed with ``--resume`` produces the same weights and metrics as an
uninterrupted one. ``--checkpoint-every N`` also commits after every N-th step inside an epoch;
the state then holds the loop's position too (step in the epoch, the running sums of the metric
row in progress, torch's RNG), so a resumption continues mid-epoch to the same bits. Saving
needs a flushed pipeline, so asynchronous schedules drain at those steps; the option is part
of the resume key, so the uninterrupted run drains at the same steps (restricting it to
synchronous schedules would have left the asynchronous ones, the long runs, without it).
``compare`` calls :func:`train` once per method in one process, so what the loop adds around
``pipe.step`` is paid by every run.

torch and the engine are imported inside the functions: ``python -m engine --help`` imports
this module and must stay fast.
"""

from __future__ import annotations

import base64
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cli import CLIError, CLIFailure
from engine.cli.config import TrainConfig, check_config
from engine.cli.outdir import claim
from engine.schedule.auto import AUTO_FACTS
from engine.cli.runlog import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    RUN_OUTPUTS,
    STAGE_COSTS_FILE,
    commit_epoch,
    read_metrics,
    read_state,
    resume_key,
    write_metrics,
)

__all__ = ["TrainResult", "train", "build_pipeline", "evaluate", "activation_bytes"]


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
    steps_run: int = 0  # steps this call trained (0: a --resume of a finished run)


class _AccuracyLoss:
    """Cross-entropy that also counts correct predictions of the training forwards.

    ``Pipeline.step`` returns only the loss; the last stage's logits reach us through the loss
    function, so counting here gives the training accuracy of exactly the micro-batches trained
    on. Calls without grad (the pipeline's one-off shape check) are not counted.

    The count is taken lazily: a counted call keeps its (detached) logits and targets, and
    :meth:`take` compares them all at once. Counting in every call meant three small tensor
    ops and a host sync (``int``) per micro-batch, which on CPU cost several times the
    cross-entropy itself and on a GPU waits for the device once per micro-batch. What is kept
    is a few numbers per sample, for at most one metric row's samples.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._logits: list[Any] = []
        self._targets: list[Any] = []
        self.correct = 0  # counts folded from the kept calls (a mid-epoch checkpoint saves them)
        self.seen = 0

    def __call__(self, out: Any, target: Any) -> Any:
        torch = self._torch
        if torch.is_grad_enabled():
            self._logits.append(out.detach())
            self._targets.append(target)
        return torch.nn.functional.cross_entropy(out, target)

    def fold(self) -> None:
        """Count the kept calls into ``correct`` / ``seen`` and release their tensors."""
        if not self._targets:
            return
        torch = self._torch
        target = torch.cat(self._targets)
        # int() waits for the comparison, so the kept tensors are read before they are released
        self.correct += int((torch.cat(self._logits).argmax(dim=1) == target).sum())
        self.seen += target.numel()
        self._logits.clear()
        self._targets.clear()

    def take(self) -> float:
        """Training accuracy of the counted calls since the last ``take``; NaN if none."""
        self.fold()
        correct, seen = self.correct, self.seen
        self.correct = self.seen = 0
        return correct / seen if seen else float("nan")


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
    cfg: TrainConfig, num_features: int, num_classes: int, updates_per_epoch: int,
    sample: Any = None,
) -> tuple[Any, list[Any], _AccuracyLoss]:
    """(pipeline, stage modules, loss) for ``cfg``; the stage modules stay usable for eval.
    ``sample`` (one micro-batch of inputs) is what ``--schedule auto`` profiles the stages on;
    their costs are kept in ``--out`` (stage_costs.json), so a resumed run chooses the same.

    The stages come from ``engine.partition.split_sequential``, so they keep the model's layer
    names: stage 1's first tensor is ``"2.…"`` at 16 layers in 8 stages, not ``"0.…"``, and a
    checkpoint's keys are the whole model's.
    """
    import torch

    import engine
    from engine.demo.models import even_balance, gpt, residual_mlp, split_layers
    from engine.cli.config import schedule_facts

    torch.manual_seed(cfg.seed)
    if cfg.task == "lm":  # tied head on every schedule (asynchronous ones: runtime/ties/carry.py)
        seq = gpt(num_classes, num_features, cfg.layers, cfg.width, tie=True).to(cfg.device)
    else:
        seq = residual_mlp(num_features, num_classes, cfg.layers, cfg.width).to(cfg.device)
    modules = split_layers(seq, even_balance(cfg.layers, cfg.stages))
    lr, momentum = cfg.effective_hparams()
    opt_kwargs: dict[str, Any] = {
        "spike_compensation": cfg.spike_compensation,
        "prediction": cfg.prediction_mode if cfg.prediction else None,
        "discrepancy_correction": cfg.discrepancy_correction,
        "correction_decay": cfg.correction_decay,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.delay_compensation:  # an option of SGD/Adam(W)/NAdam only (config refuses muon)
        opt_kwargs["delay_compensation"] = cfg.delay_compensation

    def make_optimizer(params: list[Any]) -> torch.optim.Optimizer:
        if cfg.optimizer == "nadam":  # AsyncPP's NAdamW; beta1 is --momentum
            rule = None if cfg.stage_beta1 is None else (cfg.stage_beta1, cfg.stages)
            return engine.optim.NAdam(params, lr=lr, betas=(momentum, 0.999),
                                      decoupled_weight_decay=True, stage_beta1=rule, **opt_kwargs)
        if cfg.optimizer == "muon":  # Moonlight's recipe: one lr for both parts, AdamW-matched RMS
            return engine.optim.Muon(params, lr=lr, momentum=momentum, adjust_lr_fn="match_rms_adamw",
                                     adamw_lr=None, **opt_kwargs)
        if cfg.optimizer == "basis-rotation":  # the source's script: betas (momentum, 0.999)
            return engine.optim.BasisRotation(params, lr=lr, betas=(momentum, 0.999),
                                              weight_decay=cfg.weight_decay)
        if cfg.optimizer in ("adam", "adamw"):
            cls = engine.optim.AdamW if cfg.optimizer == "adamw" else engine.optim.Adam
            return cls(params, lr=lr, betas=(momentum, 0.999), **opt_kwargs)
        return engine.optim.SGD(params, lr=lr, momentum=momentum, **opt_kwargs)

    scheduler = None
    if cfg.pipemare_lr:
        warm = cfg.pipemare_warmup if cfg.pipemare_warmup is not None else updates_per_epoch

        def scheduler(o: torch.optim.Optimizer) -> Any:
            return engine.optim.PipeMareLR(o, warm)

    loss = _AccuracyLoss()
    facts = schedule_facts(cfg.schedule)
    choose: dict[str, Any] = {}
    if facts.takes_virtual_stages:
        choose["virtual_stages"] = cfg.virtual_stages or 2
    if facts is AUTO_FACTS:  # the chooser profiles the stages once per --out
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        choose.update(sample=sample, memory_cap_bytes=cfg.memory_cap,
                      balance_profile=str(Path(cfg.out) / STAGE_COSTS_FILE))
    pipe = engine.Pipeline(
        modules,
        schedule=cfg.schedule,
        chunks=cfg.chunks,
        loss_fn=loss,
        optimizer=make_optimizer,
        checkpoint=cfg.checkpoint,
        update_size=None if facts.per_minibatch else cfg.update_size,
        order=cfg.order,
        **choose,
        weight_prediction=cfg.prediction,
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

    from engine.runtime.stage.trees import call, map_tensors, tensors

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

        # a tensor or a tree such as (h, mask); integer leaves (token ids, masks) take no grad
        inp = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), h)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = call(m, inp)
        for t in tensors(inp):
            saved.pop(t.data_ptr(), None)
        out.append(sum(t.numel() * t.element_size() for t in tensors(inp)) + sum(saved.values()))
    return out


def evaluate(modules: list[Any], x: Any, y: Any) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the stages run in sequence on (x, y), no grad."""
    import torch

    from engine.runtime.stage.trees import call

    modes = [m.training for m in modules]
    try:
        with torch.no_grad():
            h = x
            for m in modules:
                m.eval()
                h = call(m, h)
            loss = float(torch.nn.functional.cross_entropy(h, y))
            acc = float((h.argmax(dim=1) == y).float().mean())
    finally:
        for m, t in zip(modules, modes, strict=True):
            m.train(t)
    return loss, acc


# ------------------------------------------------------------------ the loop


def train(
    cfg: TrainConfig, *, save: bool = True, desc: str | None = None, position: int | None = None,
    overwrite: bool = False,
) -> TrainResult:
    """Run ``cfg`` to ``cfg.epochs`` epochs; with ``save`` write checkpoint, state and CSV to ``cfg.out``.

    A non-finite loss ends the run early with ``result.diverged`` set (no exception), so that
    a comparison records the divergence instead of aborting. A new run (no ``cfg.resume``)
    refuses a ``cfg.out`` that holds an earlier run's files, once every option is checked,
    unless ``overwrite`` (engine/cli/outdir.py).
    """
    import torch
    from tqdm import tqdm

    import engine
    from engine.demo.data import epoch_order, load_dataset, load_lm_dataset

    check_config(cfg)
    torch.set_num_threads(cfg.threads)
    data = (load_lm_dataset() if cfg.task == "lm" else load_dataset(cfg.dataset)).to(cfg.device)
    steps_per_epoch = _steps_per_epoch(cfg, len(data.train_y))
    mbs_per_epoch = steps_per_epoch * cfg.chunks
    updates_per_epoch = max(1, mbs_per_epoch * cfg.batch_size // cfg.samples_per_update())
    try:
        pipe, modules, loss_fn = build_pipeline(
            cfg, data.num_features, data.num_classes, updates_per_epoch,
            sample=data.train_x[: cfg.batch_size],
        )
    except ValueError as exc:  # PipelineConfigError: an invalid option combination
        raise CLIError(str(exc)) from None
    if pipe.schedule_choice is not None:  # the run's first line: what auto chose and why
        print(pipe.schedule_choice.reason(), flush=True)
    lr, momentum = cfg.effective_hparams()
    result = TrainResult(cfg, lr=lr, momentum=momentum)
    result.stage_param_bytes = [
        sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules
    ]
    result.stage_activation_bytes = activation_bytes(modules, data.train_x[: cfg.batch_size])
    out = Path(cfg.out)
    start_epoch = 0
    start_step = 0  # steps of epoch start_epoch done before a mid-epoch checkpoint
    samples = 0
    train_seconds = 0.0
    loss_sum, loss_n, seg_samples = 0.0, 0, 0
    seg_before = 0.0  # seconds of the metric row in progress spent before a mid-epoch resume
    if cfg.resume:
        state = read_state(out, cfg)
        start_epoch = int(state["epoch"])
        start_step = int(state.get("step_in_epoch", 0))
        if cfg.epochs < start_epoch or (start_step and cfg.epochs == start_epoch):
            done = f"{start_epoch} epochs" + (f" and {start_step} steps" if start_step else "")
            raise CLIError(
                f"--resume: the run in {out} has trained {done} already; "
                f"--epochs {cfg.epochs} is below that: pass --epochs > {start_epoch} to continue it"
            )
        try:
            engine.load(pipe, out / CHECKPOINT_FILE)
        except ValueError as exc:
            raise CLIError(f"--resume: {exc}") from None
        # the loop's own position: running sums of the metric row in progress, and the RNG
        loss_sum, loss_n = float(state.get("loss_sum", 0.0)), int(state.get("loss_n", 0))
        seg_samples = int(state.get("seg_samples", 0))
        seg_before = float(state.get("seg_seconds", 0.0))
        loss_fn.correct, loss_fn.seen = int(state.get("acc_correct", 0)), int(state.get("acc_seen", 0))
        if "rng" in state:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["rng"])), dtype=torch.uint8))
        if cfg.epochs == start_epoch:
            print(f"--resume: the run in {out} has trained its {start_epoch} epochs already; "
                  "nothing to do (raise --epochs to continue it)", file=sys.stderr)
        samples = int(state["samples"])
        train_seconds = float(state["train_seconds"])
        if (out / METRICS_FILE).exists():
            done = start_epoch * steps_per_epoch + start_step
            result.rows = [r for r in read_metrics(out / METRICS_FILE) if r["step"] <= done]
    if save:
        if not cfg.resume:  # --resume checked the run it continues (read_state)
            claim(out, RUN_OUTPUTS, overwrite=overwrite, can_resume=True)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIFailure(f"cannot create --out {out}: {exc.strerror or exc}") from None

    per_step = cfg.chunks * cfg.batch_size
    # token ids per sample (the LM's sequence length): the progress line's tokens/s
    tokens_per_sample = int(data.train_x[0].numel()) if cfg.task == "lm" else None
    evals = min(cfg.evals_per_epoch, steps_per_epoch)
    log_steps = {round((i + 1) * steps_per_epoch / evals) - 1 for i in range(evals)}
    n_train = len(data.train_y)
    stats_mark = None
    # a bar only on a terminal: in a log file its redraws are ~1,000 lines per run; there a
    # standalone run prints one line per epoch instead (compare prints one per run)
    interactive = sys.stderr.isatty()
    epoch_lines = cfg.progress and not interactive and position is None
    bar = tqdm(
        total=cfg.epochs * steps_per_epoch * per_step,
        initial=start_epoch * steps_per_epoch * per_step,
        desc=desc or cfg.label(),
        unit="sample",
        disable=not (cfg.progress and interactive),
        leave=position is None,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    def commit(epochs_done: int, step_in_epoch: int) -> None:
        """Checkpoint + train state (+ metrics) after ``step_in_epoch`` steps of the next epoch."""
        loss_fn.fold()
        rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        state = {
            "config": resume_key(cfg),
            "epoch": epochs_done,
            "step_in_epoch": step_in_epoch,
            "samples": samples,
            "train_seconds": train_seconds,
            "loss_sum": loss_sum,
            "loss_n": loss_n,
            "seg_samples": seg_samples,
            # the row in progress's time so far: its samples/s on resume spans both halves
            "seg_seconds": seg_before + time.perf_counter() - t0 if step_in_epoch else 0.0,
            "acc_correct": loss_fn.correct,
            "acc_seen": loss_fn.seen,
            "rng": rng,
            "lr": lr,
            "momentum": momentum,
        }
        commit_epoch(out, pipe, state)
        try:  # rows are filtered by the committed step on resume
            write_metrics(out / METRICS_FILE, result.rows)
        except OSError as exc:
            raise CLIFailure(f"cannot write {METRICS_FILE} to {out}: {exc.strerror or exc}") from None

    try:
        for epoch in range(start_epoch, cfg.epochs):
            order = epoch_order(n_train, cfg.seed, epoch).to(data.train_x.device)
            t0 = time.perf_counter()
            for step in range(start_step if epoch == start_epoch else 0, steps_per_epoch):
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
                result.steps_run += 1
                loss_sum += lv * per_step
                loss_n += per_step
                samples += per_step
                seg_samples += per_step
                bar.update(per_step)
                last = step == steps_per_epoch - 1
                if step in log_steps:
                    if last:
                        pipe.flush()
                    seg_t = time.perf_counter() - t0 + seg_before
                    seg_before = 0.0
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
                    speed = _speed(st, row["samples_per_s"], tokens_per_sample)
                    bar.set_postfix(
                        loss=f"{row['train_loss']:.3f}",
                        acc=f"{row['train_acc']:.3f}",
                        test=f"{test_acc:.3f}",
                        sps=f"{row['samples_per_s']:.0f}",
                        **speed,
                    )
                    t0 = time.perf_counter()
                every = cfg.checkpoint_every
                if every and not last and (epoch * steps_per_epoch + step + 1) % every == 0:
                    # state_dict needs a flushed pipeline; the drain is part of the run's
                    # trajectory (checkpoint_every is in the resume key), so a resumed run and
                    # an uninterrupted one drain at the same steps
                    pipe.flush()
                    if save:
                        commit(epoch, step + 1)
            if epoch_lines and result.rows:
                r = result.rows[-1]
                speed = _speed(pipe.stats(), r["samples_per_s"], tokens_per_sample)
                print(
                    f"{desc or cfg.label()}: epoch {epoch + 1}/{cfg.epochs} train loss "
                    f"{r['train_loss']:.4f} acc {r['train_acc']:.4f} test acc {r['test_acc']:.4f} "
                    f"({r['samples_per_s']:.0f} samples/s"
                    + (f", {speed['tps']} tokens/s" if "tps" in speed else "")
                    + f", step {speed['step']}, idle share of a step {speed['bubble']})",
                    file=sys.stderr, flush=True,
                )
            if save:
                commit(epoch + 1, 0)
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
    if save and result.rows and result.steps_run:  # a finished run resumed: leave it be
        write_metrics(out / METRICS_FILE, result.rows)
    return result


def _speed(stats: dict[str, Any], samples_per_s: float, tokens_per_sample: int | None) -> dict[str, str]:
    """The progress line's step time, bubble and (LM) tokens/s.

    The bubble is the idle share of a step twice: ``measured`` from the actions' own times
    (locally the schedule replayed with them; under gloo the rank's step time outside its
    stages' work), ``model`` the schedule's on the unit-cost clock (F = 1, B = 2), the figure
    of ``python -m engine schedule`` (engine/runtime/state/throughput.py)."""
    tp = stats.get("throughput") or {}
    step = tp.get("step_time_s")
    out = {
        "step": f"{step * 1e3:.1f}ms" if step is not None else "?",
        "bubble": f"measured {tp.get('bubble_measured', float('nan')):.2f}, "
        f"model {tp.get('bubble_modelled', float('nan')):.2f}",
    }
    if tokens_per_sample is not None:
        out["tps"] = f"{samples_per_s * tokens_per_sample:.0f}"
    return out


def _safe_stats(pipe: Any) -> dict[str, Any]:
    try:
        return pipe.stats()
    except Exception:  # stats of a pipeline that diverged mid-flight are best-effort
        return {}
