"""The engine's NCCL transport on several GPUs: against torch.distributed.pipelining, against a
bare ``batch_isend_irecv`` loop, and how much of its transfer time compute hides.

Run one process per GPU (rank 0 writes the results)::

    torchrun --standalone --nproc-per-node 4 bench/pipeline_nccl.py --out bench/results \
        --label "4x H100 SXM"

(``python bench/pipeline_nccl.py --ranks R --out DIR`` launches itself that way.) Without CUDA,
or with ``--dry-run``, every case runs on the CPU over the NCCL twin (engine.testing.nccl_twin:
``ENGINE_NCCL_TWIN=1``, so ``Pipeline(transport="nccl")`` runs its NCCL code path there, and
torch's pipelining schedules post their ops on the twin's default group) at a tiny size: a check
that the script runs end to end and that both sides compute the same losses, not a measurement.

Cases (``--cases``; all by default), every comparison in alternating paired rounds through
bench/harness.py (median time ratio with a 95 % bootstrap interval; a block is ``--steps``
mini-batches, bracketed by ``torch.cuda.synchronize`` and a barrier on a gloo group, so that it
spans the whole pipeline):

* ``vs-torch``: ``engine`` ``gpipe`` / ``1f1b`` with ``transport="nccl"`` vs torch's
  ``ScheduleGPipe`` / ``Schedule1F1B`` (``PipelineStage`` per rank, on the default NCCL group) on
  the same model: an MLP cut into one stage per rank, each stage ``--layers`` x
  (Linear(W, W) + ReLU), fp32, micro-batches of ``--micro-batch`` rows, so that an activation is
  micro-batch x W x 4 bytes (1 MiB by default: 128 x 2048), the same ``--chunks`` micro-batches
  and SGD with momentum on both sides, no activation recomputation. Before timing, both sides
  train ``--check-steps`` mini-batches from the same weights and the last stage's losses are
  compared (``extra``: ``engine_losses``, ``torch_losses``, ``loss_max_rel_diff``): the same
  math, so a speed ratio compares like with like.
* ``p2p``: a ping-pong between the ranks of each pair (0, 1), (2, 3), ... at once (an even
  world): one message down, the same tensor back up, ``--p2p-iters`` round trips per call, per
  size in ``--p2p-sizes`` (a small message for latency; 1 MiB and 64 MiB for bandwidth). The
  candidate is the engine's NCCL transport path itself: a two-stage pipeline of the pair
  (``data_parallel`` = world / 2) trains one step, which agrees the shapes, then its
  :class:`~engine.runtime.ranks.transport.nccl.NCCLTransport` sends activation i and receives
  gradient i (stage 0) while the other side receives activation i and sends it back as
  gradient i (stage 1): the calls the executor makes for SF/RF/SB/RB, on the engine's own
  direction groups. The peer is what a careful user writes: ``dist.batch_isend_irecv`` of one
  ``P2POp`` per message into preallocated buffers, on two 2-rank groups of the same kind (one
  per direction, as the engine's). Time per round trip; ``extra`` holds the one-way time and
  bandwidth (size / (round trip / 2)) of each side.
* ``hidden``: the fraction of the transfer time of a training step that compute hides, at the
  ``vs-torch`` model's activation size, for each of ``--hidden-schedules`` (1f1b by default).
  Four variants of the engine pipeline, identical but for two switches:

  - *payload*: ``full`` (each stage's W-wide output travels: the activation size) or
    ``narrow`` (each stage sends the first column of its output, micro-batch x 4 bytes, and
    the next stage expands it back to W columns: the same compute and the same dependencies,
    the messages latency-sized);
  - *work*: ``compute`` (the MLP layers) or ``empty`` (one learnable scale per stage instead).

  With T(payload, work) the step time, ``X = T(full, compute) - T(narrow, compute)`` is the
  time the payloads add to a training step (exposed transfer time), ``Y = T(full, empty) -
  T(narrow, empty)`` the time they add when nothing can hide them (transfer-only time), and

      hidden = 1 - X / Y

  1: transfers cost the training step nothing; 0: every byte's time is exposed. Fixed costs
  (host work per step, per-message latency, the barrier around a block) are in both terms of
  each difference and cancel. T is measured with CUDA events on each rank's stream: the
  block records one event at its start and one after its last step, and a round's T is the
  slowest rank's elapsed time (wall clock on the CPU twin); ``hidden`` is reported as
  ``1 - median(X) / median(Y)`` with a 95 % interval from 10 000 bootstrap resamples of the
  rounds of each difference (fixed seed). The CSV row has X and Y as candidate and peer times
  and ``median_ratio`` = exposed fraction X / Y; ``extra.hidden`` and its interval
  ``hidden_low``/``hidden_high``. When Y is not clearly positive (the payloads cost nothing
  measurable even without compute, e.g. when host work per step hides them), ``hidden`` is
  undefined and the row says so in ``note``.

Goals (printed beside the measured numbers on a GPU run): engine step time <= 0.9x torch's
(both schedules), transfers >= 90 % hidden at 1 MiB activations.

Results go to ``OUT/pipeline_nccl-<device>.csv`` (bench/harness.py's ratio schema: device
name, torch version and date in their columns, the world size in ``extra.world``); a run at
another world size adds its rows and replaces only those of its own world size, so the 2- and
4-rank runs of .ci/gpu's ``nccl`` phase share one file. The file is rewritten after every
case, so a run stopped by a budget keeps what it measured.

Estimated GPU time (an estimate: this script has not run on GPUs yet): start-up (torchrun,
CUDA, NCCL communicators) 20-40 s; ``vs-torch`` 10-20 s per schedule (mostly building the
pipelines and NCCL's lazy communicator set-up; 15 rounds x 2 blocks x 10 steps of ~2-10 ms);
``p2p`` 10-20 s (three sizes, 64 MiB round trips of ~1-6 ms); ``hidden`` 15-30 s per schedule
(four pipelines): about 70-130 s at 4 ranks with the defaults, a little less at 2; .ci/gpu's
``nccl`` phase passes ``--rounds 9`` (about 50-100 s). The CPU dry run takes 10-30 s on 2
shared cores, mostly process start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, format_size, parse_size, under_torchrun  # noqa: E402
from harness import (  # noqa: E402
    PairedResult,
    RatioRow,
    paired,
    read_ratio_csv,
    summary_line,
    write_ratio_csv,
)
from outputs import DEFAULT_OUT  # noqa: E402

#: goals of the multi-GPU run, printed beside what was measured
GOAL_VS_TORCH = 0.9  # engine step time / torch's, at most
GOAL_HIDDEN = 0.9  # fraction of transfer time hidden, at least
#: the dry run's tolerance on |engine loss - torch loss| / |torch loss| (same math, CPU fp32)
LOSS_RTOL = 1e-5

GPU_DEFAULTS = dict(width=2048, micro_batch=128, layers=2, chunks=8, steps=10, rounds=15,
                    warmup=2, check_steps=3, p2p_sizes="4,1MiB,64MiB", p2p_iters=0)
DRY_DEFAULTS = dict(width=16, micro_batch=4, layers=1, chunks=4, steps=1, rounds=3,
                    warmup=1, check_steps=3, p2p_sizes="4,1KiB,64KiB", p2p_iters=4)


# ------------------------------------------------------------------------------ the model


def mlp(s: int, width: int, layers: int) -> nn.Sequential:
    """Stage ``s`` of the MLP (seeded by the stage index: every side builds the same weights)."""
    torch.manual_seed(s)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class Scale(nn.Module):
    """The ``empty`` work of the ``hidden`` case: one learnable scale (a gradient still flows)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class HiddenStage(nn.Module):
    """Stage ``s`` of S of the ``hidden`` case: the MLP's layers (``compute``) or a scale, and
    (``narrow``) only the first column of the output travels, expanded back to ``width``
    columns by the next stage (module docstring)."""

    def __init__(self, s: int, S: int, width: int, layers: int, narrow: bool,
                 compute: bool) -> None:
        super().__init__()
        self.width = width
        self.body = mlp(s, width, layers) if compute else Scale()
        self.expand_in = narrow and s > 0
        self.narrow_out = narrow and s < S - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expand_in:
            x = x.expand(-1, self.width)
        h = self.body(x)
        return h[:, :1] if self.narrow_out else h


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def data(steps: int, rows: int, width: int, device: torch.device, seed: int = 0) -> Batches:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g).to(device),
             torch.randn(rows, width, generator=g).to(device)) for _ in range(steps)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


# ------------------------------------------------------------------------------ the two sides


class EngineRunner:
    """``engine.Pipeline(transport="nccl")``, one stage per rank; ``stages``: its factories."""

    def __init__(self, schedule: str, stages: list[Callable[[], nn.Module]], M: int,
                 timeout: float) -> None:
        from engine import Pipeline

        self.pipe = Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                             optimizer=_sgd, checkpoint="never", transport="nccl", timeout=timeout)
        S = len(stages)
        held = {st.index for st in self.pipe.stages}
        self.first, self.last = 0 in held, S - 1 in held

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One mini-batch; the loss on the last stage's rank (None elsewhere)."""
        loss = self.pipe.step(x if self.first else None, y if self.last else None)
        return float(loss) if self.last else None

    def run(self, batches: Batches) -> None:
        for x, y in batches:
            self.pipe.step(x if self.first else None, y if self.last else None)
        self.pipe.flush()


class TorchRunner:
    """torch.distributed.pipelining on the default group, the same stage modules (keyword
    arguments: some moved between torch versions, see docs/ENVIRONMENT.md)."""

    def __init__(self, schedule: str, S: int, M: int, width: int, layers: int,
                 device: torch.device) -> None:
        from torch.distributed import pipelining as tp

        s = dist.get_rank()
        self.module = mlp(s, width, layers).to(device)
        stage = tp.PipelineStage(submodule=self.module, stage_index=s, num_stages=S, device=device)
        cls = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B}[schedule]
        self.schedule = cls(stage, n_microbatches=M, loss_fn=nn.functional.mse_loss)
        self.opt = _sgd(self.module.parameters())
        self.first, self.last = s == 0, s == S - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One mini-batch; the mean of the micro-batch losses on the last rank (None elsewhere):
        the engine's loss, a mean over samples, for equal micro-batches."""
        losses = self._step(x, y)
        return float(torch.stack(losses).detach().mean()) if self.last else None

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        return losses

    def run(self, batches: Batches) -> None:
        for x, y in batches:
            self._step(x, y)  # (the losses stay on the device: no host read)


# ------------------------------------------------------------------------------ measuring


class Sync:
    """What brackets a block: the device drained, then a barrier on a gloo group (a host
    barrier: NCCL's would queue behind the pipelines' own communicators)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.group = dist.new_group(backend="gloo")

    def __call__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.group)


class BlockEvents:
    """A harness probe (name ``device``): the time from a block's start to its last kernel on
    this rank's stream, from two CUDA events the block itself records (:meth:`wrap`); the
    wall clock inside the block on the CPU."""

    name = "device"

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._begin: Any = None
        self._end: Any = None

    def wrap(self, fn: Callable[[], None]) -> Callable[[], None]:
        def block() -> None:
            self._begin = self._mark()
            fn()
            self._end = self._mark()

        return block

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        return None

    def stop(self, token: None) -> float:
        if not self.cuda:
            return float(self._end - self._begin)
        self._end.synchronize()
        return float(self._begin.elapsed_time(self._end)) / 1e3


def slowest_rank(res: PairedResult, probe: str, host: Any) -> tuple[list[float], list[float]]:
    """Per round, the slowest rank's value of ``probe`` (seconds per call), both sides."""
    mine = tuple(res.probe_rounds[f"{side}_{probe}_per_call"] for side in ("candidate", "peer"))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=host)
    cand = [max(r[0][i] for r in every) for i in range(res.rounds)]
    peer = [max(r[1][i] for r in every) for i in range(res.rounds)]
    return cand, peer


def hidden_stats(x: list[float], y: list[float], resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float, float, float, float, float]:
    """``1 - median(x) / median(y)`` and its 95 % percentile-bootstrap interval (the rounds of
    x and of y resampled independently: they are separate measurements), and the same
    interval for median(y) alone. Returns (hidden, low, high, exposed fraction, y low, y high);
    the hidden values are NaN when y's interval reaches zero (no measurable transfer time)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    rng = np.random.default_rng(seed)
    mx = np.median(xs[rng.integers(0, xs.size, (resamples, xs.size))], axis=1)
    my = np.median(ys[rng.integers(0, ys.size, (resamples, ys.size))], axis=1)
    y_low, y_high = (float(v) for v in np.percentile(my, [2.5, 97.5]))
    if not y_low > 0:
        nan = float("nan")
        return nan, nan, nan, nan, y_low, y_high
    exposed = float(np.median(xs) / np.median(ys))
    low, high = np.percentile(1 - mx / my, [2.5, 97.5])
    return 1 - exposed, float(low), float(high), exposed, y_low, y_high


# ------------------------------------------------------------------------------ p2p


class EngineLink:
    """The engine's NCCL transport between the two stages of a pair (``p2p`` case)."""

    def __init__(self, numel: int, device: torch.device, timeout: float) -> None:
        from engine import Pipeline

        world = dist.get_world_size()
        self.pipe = Pipeline([Scale, Scale], schedule="gpipe", chunks=1,
                             loss_fn=nn.functional.mse_loss, optimizer=_sgd, checkpoint="never",
                             transport="nccl", data_parallel=world // 2, timeout=timeout)
        self.stage = self.pipe.stages[0].index
        x = torch.zeros(1, numel, device=device)
        # one step agrees the shapes (the handshake)
        self.pipe.step(x if self.stage == 0 else None, x if self.stage == 1 else None)
        self.pipe.flush()
        self.tp = self.pipe.parts.rank.transport
        # (an activation that requires grad, as the handshake agreed: its gradient travels back)
        self.buf = torch.ones(1, numel, device=device, requires_grad=True)
        self.mb = 1 << 20  # micro-batch ids of its own, away from the step's

    def run(self, iters: int) -> None:
        tp = self.tp
        for _ in range(iters):
            self.mb += 1
            if self.stage == 0:
                tp.send("act", 0, self.mb, self.buf)
                tp.recv("grad", 0, self.mb)
            else:
                back = tp.recv("act", 1, self.mb)
                tp.send("grad", 1, self.mb, back)
        tp.wait_sends()


class BareLink:
    """``dist.batch_isend_irecv`` ping-pong on two 2-rank groups per pair (one per direction)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.down = self.up = None
        for a in range(0, world - 1, 2):  # every rank creates every group, in the same order
            pair = [a, a + 1]
            down, up = dist.new_group(pair), dist.new_group(pair)
            if rank in pair:
                self.down, self.up = down, up
        self.peer = rank ^ 1
        self.first = rank % 2 == 0
        self.buf = torch.ones(numel, device=device)
        self.back = torch.empty(numel, device=device)

    def run(self, iters: int) -> None:
        def one(op: Callable[..., Any], t: torch.Tensor, group: Any) -> None:
            for w in dist.batch_isend_irecv([dist.P2POp(op, t, self.peer, group)]):
                w.wait()

        for _ in range(iters):
            if self.first:
                one(dist.isend, self.buf, self.down)
                one(dist.irecv, self.back, self.up)
            else:
                one(dist.irecv, self.back, self.down)
                one(dist.isend, self.back, self.up)


def p2p_iters(size: int) -> int:
    """Round trips per call: ~256 MiB moved per block, between 4 and 200 round trips."""
    return max(4, min(200, (256 << 20) // max(size, 1)))


# ------------------------------------------------------------------------------ results


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_rows(rows: list[RatioRow], path: Path, world: int) -> None:
    """``rows`` and the rows of other world sizes already in ``path`` (module docstring)."""
    kept: list[RatioRow] = []
    if path.exists():
        try:
            kept = [r for r in read_ratio_csv(path) if r.extra.get("world") != world]
        except (ValueError, KeyError, TypeError):
            print(f"{path}: not the ratio schema; rewritten", flush=True)
    write_ratio_csv(kept + rows, path)


def goal_line(what: str, value: float, low: float, high: float, goal: str,
              met: bool | None) -> str:
    verdict = "not judged (CPU dry run)" if met is None else "met" if met else "NOT met"
    return f"goal {what}: measured {value:.3f} [{low:.3f}, {high:.3f}] (goal {goal}): {verdict}"


@dataclasses.dataclass
class Run:
    """What every case of one run shares."""

    args: argparse.Namespace
    cuda: bool
    device: torch.device
    sync: Sync
    path: Path
    batches: Batches
    check: Batches
    meta: dict[str, Any]
    note: str
    rows: list[RatioRow] = dataclasses.field(default_factory=list)
    goals: list[str] = dataclasses.field(default_factory=list)

    @property
    def world(self) -> int:
        return dist.get_world_size()

    def say(self, *text: str) -> None:
        if dist.get_rank() == 0:
            print(*text, flush=True)

    def record(self, row: RatioRow) -> None:
        """Keep ``row`` and rewrite the CSV (a run stopped later keeps it)."""
        self.rows.append(row)
        if dist.get_rank() == 0:
            write_rows(self.rows, self.path, self.world)

    def timed(self, cand: Callable[[], None], peer: Callable[[], None], units: int,
              probes: Any = ()) -> PairedResult:
        # every rank runs the same rounds in the same order (inner fixed: no per-rank
        # calibration), so the barriers inside each block line up across ranks
        a = self.args
        return paired(cand, peer, rounds=a.rounds, warmup=a.warmup, inner=1, sync=self.sync,
                      units_per_call=units, probes=probes, device=self.device)

    def judged(self, met: bool) -> bool | None:
        return met if self.cuda else None


def case_vs_torch(run: Run, schedule: str) -> None:
    a, S = run.args, run.world
    ours = EngineRunner(schedule, [lambda i=i: mlp(i, a.width, a.layers) for i in range(S)],
                        a.chunks, a.timeout)
    theirs = TorchRunner(schedule, S, a.chunks, a.width, a.layers, run.device)
    # the same math: both sides train the same mini-batches from the same weights
    mine = ([ours.step(x, y) for x, y in run.check], [theirs.step(x, y) for x, y in run.check])
    every: list[Any] = [None] * S
    dist.all_gather_object(every, mine, group=run.sync.group)
    got, want = every[S - 1]  # (the last stage's rank computes both sides' losses)
    rel = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))
    res = run.timed(lambda: ours.run(run.batches), lambda: theirs.run(run.batches), a.steps)
    row = res.row("vs_torch", schedule, f"engine {schedule} nccl",
                  f"torch {type(theirs.schedule).__name__}", label=a.label, note=run.note,
                  extra={**run.meta, "engine_losses": got, "torch_losses": want,
                         "loss_max_rel_diff": rel})
    run.record(row)
    run.say(summary_line(row), f"[{row.candidate_ms:.2f} vs {row.peer_ms:.2f} ms/step]; "
            f"losses over {len(got)} steps: max relative difference {rel:.2e}")
    run.goals.append(goal_line(f"engine/torch step time, {schedule}", row.median_ratio,
                               row.ci_low, row.ci_high, f"<= {GOAL_VS_TORCH}",
                               run.judged(row.ci_high <= GOAL_VS_TORCH)))


def case_p2p(run: Run, size: int) -> None:
    a, S = run.args, run.world
    iters = a.p2p_iters or p2p_iters(size)
    ours = EngineLink(size // 4, run.device, a.timeout)
    bare = BareLink(size // 4, run.device)
    res = run.timed(lambda: ours.run(iters), lambda: bare.run(iters), iters)
    kind = "latency" if size < (64 << 10) else "bandwidth"
    rt_c, rt_p = (float(np.median(t)) for t in (res.candidate_s, res.peer_s))  # s per round trip
    row = res.row("p2p", f"{kind} {format_size(size)}", "engine NCCLTransport send/recv",
                  "bare dist.batch_isend_irecv", label=a.label, note=run.note,
                  extra={"world": S, "bytes": size, "round_trips_per_call": iters,
                         "pairs": S // 2, "candidate_one_way_us": rt_c * 1e6 / 2,
                         "peer_one_way_us": rt_p * 1e6 / 2,
                         "candidate_GBps": size / (rt_c / 2) / 1e9,
                         "peer_GBps": size / (rt_p / 2) / 1e9})
    run.record(row)
    run.say(summary_line(row), f"[round trip {rt_c * 1e6:.1f} vs {rt_p * 1e6:.1f} us; "
            f"{row.extra['candidate_GBps']:.3g} vs {row.extra['peer_GBps']:.3g} GB/s one way]")


def case_hidden(run: Run, schedule: str) -> None:
    a, S = run.args, run.world
    clock = BlockEvents(run.cuda)
    diffs: list[list[float]] = []
    results: list[PairedResult] = []
    for compute in (True, False):  # X, then Y (module docstring)
        full, narrow = (
            EngineRunner(schedule, [functools.partial(HiddenStage, i, S, a.width, a.layers, n,
                                                      compute) for i in range(S)],
                         a.chunks, a.timeout)
            for n in (False, True)
        )
        res = run.timed(clock.wrap(lambda full=full: full.run(run.batches)),
                        clock.wrap(lambda narrow=narrow: narrow.run(run.batches)), 1, [clock])
        cand, peer = slowest_rank(res, clock.name, run.sync.group)
        diffs.append([(c - p) / a.steps for c, p in zip(cand, peer, strict=True)])
        results.append(res)
        del full, narrow
    x, y = diffs
    hidden, low, high, exposed, y_low, y_high = hidden_stats(x, y)
    undefined = hidden != hidden
    why = (f"hidden undefined: the transfer-only time's interval [{y_low * 1e3:.3f}, "
           f"{y_high * 1e3:.3f}] ms/step reaches 0" if undefined else "")
    clock_name = "cuda events" if run.cuda else "wall clock"
    row = results[1].row(
        "hidden", schedule, "exposed transfer time X", "transfer-only time Y", label=a.label,
        note="; ".join(t for t in (run.note, why) if t),
        extra={**run.meta, "hidden": hidden, "hidden_low": low, "hidden_high": high,
               "X_ms": [v * 1e3 for v in x], "Y_ms": [v * 1e3 for v in y],
               "clock": f"{clock_name}, slowest rank"})
    (x20, x50, x80), (y20, y50, y80) = (np.quantile(v, [0.2, 0.5, 0.8]) * 1e3 for v in (x, y))
    row = dataclasses.replace(
        row, median_ratio=exposed, ci_low=1 - high, ci_high=1 - low, candidate_ms=float(x50),
        candidate_p20_ms=float(x20), candidate_p80_ms=float(x80), peer_ms=float(y50),
        peer_p20_ms=float(y20), peer_p80_ms=float(y80), load_before=results[0].load_before)
    run.record(row)
    act = format_size(run.meta["activation_bytes"])
    run.say(f"hidden {schedule}: {hidden:.3f} [{low:.3f}, {high:.3f}] of the transfer time (X = "
            f"{row.candidate_ms:.3f} ms/step exposed of Y = {row.peer_ms:.3f} ms/step; {act} "
            "activations)" + (f" -- {why}" if why else ""))
    run.goals.append(goal_line(f"transfers hidden, {schedule}, {act} activations", hidden, low,
                               high, f">= {GOAL_HIDDEN}",
                               run.judged(not undefined and low >= GOAL_HIDDEN)))


# ------------------------------------------------------------------------------ main


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2,
                    help="processes (one GPU each) when not started by torchrun")
    ap.add_argument("--cases", nargs="*", default=["vs-torch", "p2p", "hidden"],
                    choices=["vs-torch", "p2p", "hidden"])
    ap.add_argument("--schedules", nargs="*", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"],
                    help="schedules of the vs-torch case")
    ap.add_argument("--hidden-schedules", nargs="*", default=["1f1b"], choices=["gpipe", "1f1b"])
    ap.add_argument("--width", type=int, help="W, the MLP's width (GPU 2048; dry run 16)")
    ap.add_argument("--micro-batch", type=int,
                    help="rows per micro-batch (GPU 128: 1 MiB activations)")
    ap.add_argument("--layers", type=int, help="Linear+ReLU layers per stage (GPU 2)")
    ap.add_argument("--chunks", type=int, help="M, micro-batches per mini-batch (GPU 8)")
    ap.add_argument("--steps", type=int, help="mini-batches per timed block (GPU 10)")
    ap.add_argument("--rounds", type=int, help="paired rounds per comparison (GPU 15)")
    ap.add_argument("--warmup", type=int, help="untimed blocks of each side first (GPU 2)")
    ap.add_argument("--check-steps", type=int, help="mini-batches of the loss check (3)")
    ap.add_argument("--p2p-sizes", help="message sizes of the p2p case (GPU '4,1MiB,64MiB')")
    ap.add_argument("--p2p-iters", type=int,
                    help="round trips per call (GPU: 0, chosen per size: ~256 MiB a block, 4-200)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, over the NCCL twin, tiny sizes (automatic without CUDA)")
    ap.add_argument("--label", default="", help="machine label for the CSV")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.dry_run = args.dry_run or not torch.cuda.is_available()
    for key, value in (DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("width", "micro_batch", "layers", "chunks", "steps", "rounds", "check_steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} {getattr(args, key)} must be >= 1")
    if args.warmup < 0 or args.p2p_iters < 0:
        ap.error("--warmup and --p2p-iters must be >= 0")
    try:
        args.sizes = [parse_size(t.strip()) for t in args.p2p_sizes.split(",")]
    except ValueError:
        ap.error(f"--p2p-sizes {args.p2p_sizes!r}: a comma-separated list of sizes such as "
                 "'4,1MiB,64MiB'")
    bad = [n for n in args.sizes if n < 4 or n % 4]
    if bad:
        ap.error(f"--p2p-sizes: {bad} bytes are not a whole number (>= 1) of float32s")
    return ap, args


def main() -> None:
    ap, args = parse()
    if args.dry_run:
        os.environ["ENGINE_NCCL_TWIN"] = "1"  # (inherited by the ranks under_torchrun starts)
    elif "RANK" not in os.environ and torch.cuda.device_count() < args.ranks:
        ap.error(f"--ranks {args.ranks} needs {args.ranks} GPUs (NCCL: one rank per GPU); "
                 f"{torch.cuda.device_count()} visible")
    under_torchrun(args.ranks, __file__)

    timeout = datetime.timedelta(seconds=args.timeout)
    cuda = not args.dry_run
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout)
    else:
        from engine.testing import nccl_twin

        assert nccl_twin.BACKEND == "nccl_twin"  # (importing it registers the backend)
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("nccl_twin", timeout=timeout)
    S = dist.get_world_size()
    if S < 2:
        raise SystemExit("pipeline_nccl: needs >= 2 ranks")
    name = device_name(device) if cuda else "cpu, NCCL twin (dry run)"
    M, b, W = args.chunks, args.micro_batch, args.width
    run = Run(
        args, cuda, device, Sync(cuda),
        args.out / f"pipeline_nccl-{slug(name) if cuda else 'cpu-twin'}.csv",
        data(args.steps, M * b, W, device), data(args.check_steps, M * b, W, device, seed=1),
        dict(world=S, chunks=M, micro_batch=b, width=W, layers=args.layers, steps=args.steps,
             activation_bytes=b * W * 4),
        "" if cuda else "dry run: CPU, NCCL twin, tiny sizes; not a measurement",
    )
    run.say(f"pipeline_nccl: {S} ranks on {name}, torch {torch.__version__}; activations "
            f"{format_size(b * W * 4)} ({b} x {W} fp32), M={M}, layers per stage: {args.layers}"
            + ("" if cuda else " -- DRY RUN over the NCCL twin"))
    if "vs-torch" in args.cases:
        for schedule in args.schedules:
            case_vs_torch(run, schedule)
    if "p2p" in args.cases:
        if S % 2:
            run.say(f"p2p: skipped (it pairs the ranks: an even world, not {S})")
        for size in args.sizes if S % 2 == 0 else []:
            case_p2p(run, size)
    if "hidden" in args.cases:
        for schedule in args.hidden_schedules:
            case_hidden(run, schedule)
    for line in run.goals:
        run.say(line)
    run.say(f"wrote {run.path}")
    run.sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
