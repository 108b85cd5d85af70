"""``report.md`` of ``python -m engine compare``: the table, the figures, and what every number
in them means.

Why its own module: the report is read by people who did not write the code; each number
needs a sentence saying what was measured, how, and how much it can be trusted (a test-set
accuracy on 359 images moves by whole images, samples/s on a shared machine moves with
other people's jobs, a two-step timeline overstates an asynchronous schedule's bubble).
Keeping that text here keeps compare.py about running the comparison.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from engine.cli.config import TrainConfig

__all__ = ["machine_line", "write_report"]


def machine_line() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    # torch picks its CPU kernels by instruction set at run time (ATEN_CPU_CAPABILITY
    # overrides), and they round differently (log_softmax under AVX2 vs AVX512): the same
    # command reproduces a table bit for bit only with the same kernels
    kernels = torch.backends.cpu.get_cpu_capability()
    return (
        f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), torch CPU kernels {kernels}, {dev}, "
        f"Python {platform.python_version()}"
    )


def _hyper(base: TrainConfig) -> str:
    if not base.ref_batch:
        rule = "used as given (no scaling)."
    elif base.scaling == "per-sample":
        rule = (f"at B_ref = {base.ref_batch} samples per update, scaled per method to its B: "
                "m = m_ref ^ (B / B_ref), lr = lr_ref * (B / B_ref) * (1 - m) / (1 - m_ref) "
                "(`--scaling per-sample`: each sample's total step fixed with PyTorch's "
                "undampened momentum).")
    else:
        rule = (f"at B_ref = {base.ref_batch} samples per update, scaled per method to its B: "
                "m = m_ref ^ (B / B_ref), lr = lr_ref * B / B_ref (`--scaling linear`).")
    return (f"Hyper-parameters: {base.optimizer.upper()} with reference lr_ref = {base.lr}, "
            f"m_ref = {base.momentum} {rule} Nothing is tuned per method.")


def _columns(target: float, seeds: list[int]) -> list[str]:
    """One line per column of the table: what it is and how far to trust it."""
    seed_note = (f" Each method ran once per seed ({', '.join(map(str, seeds))}): one row per "
                 "run, same data and split, seeded initial weights and data order."
                 if len(seeds) > 1 else "")
    return [
        "What each column is:" + seed_note,
        "",
        "- *S*: pipeline stages; *B/upd*: samples per optimizer update (k micro-batches of the "
        "micro-batch size); *lr*, *m*: the learning rate and momentum after the scaling rule "
        "above.",
        "- *final acc*: test accuracy after the last step. One test image is 1 / (test set "
        "size) of it, and seeds move it by 1-2 points: differences below that are noise.",
        "- *last-epoch mean*: the mean test accuracy over the last epoch's evaluation points "
        "(steadier than the final one); *best acc*: the highest evaluation of the run.",
        "- *train loss*: mean training loss over the last epoch, over many more samples than "
        "the test set: the least noisy column and the one to rank methods by.",
        f"- *upd→target*, *samples→target*: updates and samples until the test accuracy first "
        f"reached {target}, read at the evaluation points (so coarse); 'never' if it did not.",
        "- *samples/s*: training samples per second of wall time, evaluation excluded. On a "
        "shared machine this is noise from other jobs (runs minutes apart see different "
        "loads; it moved by 20-40 % between identical runs on 2 shared cores): compare speed "
        "with the paired benchmarks under bench/, not with this column.",
        "- *weights KiB*: peak weight buffers the engine held per stage x that stage's "
        "parameter bytes, summed over stages (stashed versions, predictions, transients).",
        "- *act KiB*: peak micro-batches stashed per stage x the bytes one micro-batch leaves "
        "saved at that stage (measured with autograd's saved-tensor hooks), summed.",
        "- *delays*: per stage, the delay (updates between a micro-batch's forward and its "
        "update) most micro-batches saw, counted by the engine.",
        "- *bubble*: idle share of stage time over the whole run on the engine's unit-cost "
        "clock (F = 1, B = 2). Synchronous schedules drain every mini-batch, so theirs is "
        "(S-1)/(M+S-1); asynchronous ones fill once and never drain, so theirs is near 0. The "
        "timelines below draw only 2 steps from an empty pipeline, so their titles show a "
        "larger bubble for the asynchronous schedules: fill and drain, which a run pays once.",
    ]


def write_report(
    path: Path,
    table: str,
    base: TrainConfig,
    methods: list[tuple[str, str]],
    depths: list[int],
    images: list[Path],
    command: str,
    wall: float,
    target: float,
    seeds: list[int],
    spread: str,
) -> None:
    model = "GPT-style decoder" if base.task == "lm" else "residual MLP"
    seed_text = f"seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    lines = [
        "# Pipeline methods compared",
        "",
        f"Command: `{command}`",
        "",
        f"Wall time: {wall:.0f} s. Machine: {machine_line()}.",
        "",
        f"Data: {base.data_name}. Model: {model}, {base.layers} layers, width {base.width}, "
        f"split evenly into S = {', '.join(map(str, depths))} stages; {base.batch_size} "
        f"sample(s) per micro-batch; {base.epochs} epochs; {seed_text}; activation "
        f"recomputation `{base.checkpoint}`.",
        "",
        _hyper(base),
        "",
        "Methods: " + "; ".join(f"`{n}`: {what}" for n, what in methods) + ".",
        "",
        *_columns(target, seeds),
        "",
        table,
        "",
        "Figures: `final_S{S}.png` ranks the methods by last-epoch training loss (best on "
        f"top) and shows their final test accuracy ({spread}); `curves_S{{S}}.png` shows "
        "test accuracy and training loss along the run, one panel per method family with the "
        "first synchronous method in grey as the reference; `depth.png` (several S) the mean "
        "over seeds against S; `timeline_*.png` each schedule's order of work.",
        "",
    ]
    for img in images:
        lines += [f"![{img.stem}]({img.name})", ""]
    path.write_text("\n".join(lines))
