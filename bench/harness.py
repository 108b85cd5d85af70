"""The one ratio harness every benchmark under bench/ shares.

Project rule: these machines are shared and noisy, so a speed ratio counts only when it comes
from *alternating paired rounds*, reported as a median with a 95 % interval. Why paired
rounds: load from other users drifts on a scale of seconds; timing the candidate for a while
and then the peer for a while lets that drift land on one side only. Here every round times
one block of the candidate and one block of the peer back to back, so both see nearly the
same machine, and the per-round ratio cancels most of the drift. The order alternates
(AB, BA, AB, ...) so neither side always runs first (the first block of a pair pays for cold
caches and the other side's garbage). The median of the per-round ratios is robust to the
rounds another process disturbed; its percentile-bootstrap interval (fixed seed, so a rerun of
the statistics gives the same numbers) says how far it can be trusted.

Use::

    res = paired(candidate, peer, rounds=21, warmup=2)
    row = res.row("overhead", "tiny S=8 gpipe", "engine gpipe", "hand-written loop")
    print(summary_line(row))
    write_ratio_csv([row], out / "overhead.csv")

Times are ``time.perf_counter`` around a block of ``inner`` calls; with ``device`` a CUDA
device, ``torch.cuda.synchronize`` brackets every block. Distributed benchmarks pass
``sync=dist.barrier`` (and an explicit ``inner``, identical on every rank) so a block spans the
whole pipeline. ``probes`` record extra per-call quantities (e.g. minor page faults, or device
time from CUDA events) over the same blocks; ``PairedResult.by_probe(name)`` turns one of them
into a paired ratio with its own interval. ``setup(side)`` runs before each of a side's blocks,
outside the timer, where the two sides differ by a device setting rather than by a callable
(bench/l2_persistence.py switches an L2 window on and off that way).

Kernel microbenchmarks that report bandwidth keep ``common.Row``; every *ratio* goes through
this module and its CSV schema (``RatioRow``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, versions  # noqa: E402
from outputs import DEFAULT_OUT  # noqa: E402

__all__ = [
    "Probe",
    "MinorFaults",
    "RatioStats",
    "PairedResult",
    "RatioRow",
    "RATIO_COLUMNS",
    "paired",
    "round_order",
    "ratio_stats",
    "quantiles",
    "summary_line",
    "write_ratio_csv",
    "read_ratio_csv",
]

SIDES = ("candidate", "peer")


class Probe(Protocol):
    """An extra quantity measured over the same timed blocks, reported per call.

    ``start()`` runs just before a block's timer starts and returns an opaque token;
    ``stop(token)`` runs just after it stops and returns the block's total (the harness
    divides by the calls in the block). Keep both cheap: they sit next to the timed window.
    """

    name: str

    def start(self) -> Any: ...

    def stop(self, token: Any) -> float: ...


class MinorFaults:
    """Minor page faults of this process (``ru_minflt``), e.g. to see an allocator that
    returns memory to the OS and faults it back in on every step."""

    name = "minflt"

    def start(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def stop(self, token: int) -> float:
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - token)


class ThreadCPU:
    """CPU time of the calling thread (``time.thread_time``): the host work of a rank's main
    thread, without its waits and without other threads (gloo's loop thread)."""

    name = "thread_cpu"

    def start(self) -> float:
        return time.thread_time()

    def stop(self, token: float) -> float:
        return time.thread_time() - token


class ProcessCPU:
    """CPU time of the whole process, every thread (``time.process_time``): minus
    :class:`ThreadCPU`, what the communication library's threads spent."""

    name = "process_cpu"

    def start(self) -> float:
        return time.process_time()

    def stop(self, token: float) -> float:
        return time.process_time() - token


# ------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class RatioStats:
    """Median of per-round ratios and its percentile-bootstrap interval."""

    median: float
    low: float
    high: float
    confidence: float


def ratio_stats(
    candidate: Sequence[float],
    peer: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> RatioStats:
    """Median of ``candidate[i] / peer[i]`` over rounds, with a percentile bootstrap interval.

    The pairs are resampled as pairs (a round's two times belong together: that is the point
    of pairing). The seed is fixed so the same timings always give the same interval.
    """
    c = np.asarray(candidate, dtype=np.float64)
    p = np.asarray(peer, dtype=np.float64)
    if c.shape != p.shape or c.ndim != 1:
        raise ValueError(
            f"ratio_stats: candidate and peer need one time per round each; got shapes "
            f"{c.shape} and {p.shape}"
        )
    if c.size == 0:
        raise ValueError("ratio_stats: no rounds to summarise (rounds must be >= 1)")
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(p)) and np.all(p > 0) and np.all(c >= 0)):
        raise ValueError(
            "ratio_stats: times must be finite, candidate >= 0 and peer > 0; got "
            f"candidate={c.tolist()}, peer={p.tolist()}"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"ratio_stats: confidence={confidence} must lie in (0, 1)")
    ratios = c / p
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, ratios.size, size=(resamples, ratios.size))
    meds = np.median(ratios[idx], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(meds, [tail, 100 - tail])
    return RatioStats(float(np.median(ratios)), float(low), float(high), confidence)


def quantiles(values: Sequence[float], qs: Sequence[float] = (0.2, 0.5, 0.8)) -> list[float]:
    """Linear-interpolated quantiles (numpy's default), one per entry of ``qs``."""
    if len(values) == 0:
        raise ValueError("quantiles: no values")
    return [float(x) for x in np.quantile(np.asarray(values, dtype=np.float64), list(qs))]


def round_order(rounds: int) -> list[tuple[str, str]]:
    """Which side runs first in each round: AB, BA, AB, ... (so neither always leads)."""
    return [SIDES if r % 2 == 0 else SIDES[::-1] for r in range(rounds)]


# ------------------------------------------------------------------------------- the harness


@dataclass
class PairedResult:
    """What ``paired`` measured: per-round times (seconds per unit), statistics, machine."""

    candidate_s: list[float]
    peer_s: list[float]
    order: list[tuple[str, str]]
    stats: RatioStats
    inner: int
    load_before: float
    load_after: float
    cpus: int
    device: str
    extra: dict[str, float] = field(default_factory=dict)
    #: every probe's per-call value in every round, keyed like ``extra``
    probe_rounds: dict[str, list[float]] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return len(self.candidate_s)

    def by_probe(self, name: str) -> PairedResult:
        """The same rounds with probe ``name``'s per-call values in place of the clock's times.

        For a probe that measures a time (e.g. device time from CUDA events around part of a
        call), this is the paired ratio of that time with its own bootstrap interval; the
        round pairing, order and machine record are those of the original measurement.
        """
        key_c, key_p = f"candidate_{name}_per_call", f"peer_{name}_per_call"
        if key_c not in self.probe_rounds:
            known = sorted({k.split("_", 1)[1].removesuffix("_per_call") for k in self.probe_rounds})
            raise KeyError(f"by_probe: no probe named {name!r} in this result (probes: {known})")
        c, p = self.probe_rounds[key_c], self.probe_rounds[key_p]
        stats = ratio_stats(c, p, confidence=self.stats.confidence)
        return dataclasses.replace(self, candidate_s=list(c), peer_s=list(p), stats=stats)

    def row(
        self,
        benchmark: str,
        case: str,
        candidate: str,
        peer: str,
        *,
        label: str = "",
        note: str = "",
        extra: dict[str, float] | None = None,
    ) -> RatioRow:
        """The CSV row of this measurement (``extra`` adds case metadata, e.g. a theory ratio)."""
        c20, c50, c80 = quantiles(self.candidate_s)
        p20, p50, p80 = quantiles(self.peer_s)
        ver = versions()
        return RatioRow(
            benchmark=benchmark,
            case=case,
            candidate=candidate,
            peer=peer,
            rounds=self.rounds,
            inner=self.inner,
            median_ratio=self.stats.median,
            ci_low=self.stats.low,
            ci_high=self.stats.high,
            candidate_ms=c50 * 1e3,
            candidate_p20_ms=c20 * 1e3,
            candidate_p80_ms=c80 * 1e3,
            peer_ms=p50 * 1e3,
            peer_p20_ms=p20 * 1e3,
            peer_p80_ms=p80 * 1e3,
            extra={**self.extra, **(extra or {})},
            load_before=self.load_before,
            load_after=self.load_after,
            cpus=self.cpus,
            device=self.device,
            label=label,
            torch=ver["torch"],
            triton=ver["triton"],
            engine=ver["engine"],
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            note=note,
        )


def _calibrate(
    fns: dict[str, Callable[[], object]],
    sync: Callable[[], None],
    min_time: float,
    tries: int = 3,
    setup: Callable[[str], None] | None = None,
) -> int:
    """Calls per block so that the faster side's block lasts at least ``min_time`` seconds.

    Each side's call time is the fastest of ``tries`` calls: one call disturbed by another
    process would otherwise shrink every block of the run.
    """
    fastest = math.inf
    for _ in range(tries):
        for side, fn in fns.items():
            if setup is not None:
                setup(side)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            fastest = min(fastest, time.perf_counter() - t0)
    return max(1, math.ceil(min_time / max(fastest, 1e-9)))


def paired(
    candidate: Callable[[], object],
    peer: Callable[[], object],
    *,
    rounds: int,
    warmup: int = 1,
    inner: int | None = None,
    min_time: float = 0.05,
    device: torch.device | str = "cpu",
    sync: Callable[[], None] | None = None,
    probes: Sequence[Probe] = (),
    units_per_call: int = 1,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
    setup: Callable[[str], None] | None = None,
) -> PairedResult:
    """Time ``candidate`` against ``peer`` in ``rounds`` alternating paired rounds.

    Args:
        rounds: paired rounds; each times one block of each side (order AB, BA, ...).
        warmup: untimed calls of each side first (alternating too), so caches, allocators
            and asynchronous pipelines reach steady state before any timing.
        inner: calls per block, the same for both sides. ``None`` calibrates it once after the
            warm-up so the faster side's block lasts ``min_time``. Pass it explicitly where
            several processes must agree (distributed runs).
        device: a CUDA device adds ``torch.cuda.synchronize`` around every block.
        sync: a callable run before the timer starts and before it stops (e.g.
            ``dist.barrier``); replaces the CUDA synchronisation when given.
        probes: extra per-call measurements over the same blocks (``MinorFaults()``); the
            result's ``extra`` holds ``{side}_{probe}_per_call`` medians over rounds.
        units_per_call: work units one call performs (e.g. mini-batches); times are
            reported per unit. Ratios do not depend on it.
        setup: called with the side's name (``"candidate"`` or ``"peer"``) before each of
            its warm-up calls, calibration calls and timed blocks, outside the timer: for
            sides that differ by a device setting (an L2 window on or off) rather than by
            what they call. Keep it idempotent; it runs once per block, not per call.
    """
    if rounds < 1:
        raise ValueError(f"paired: rounds={rounds} must be >= 1")
    if warmup < 0:
        raise ValueError(f"paired: warmup={warmup} must be >= 0")
    if inner is not None and inner < 1:
        raise ValueError(f"paired: inner={inner} must be >= 1 (or None to calibrate)")
    if units_per_call < 1:
        raise ValueError(f"paired: units_per_call={units_per_call} must be >= 1")
    dev = torch.device(device)
    if sync is None:
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    fns = {"candidate": candidate, "peer": peer}
    load_before = os.getloadavg()[0]
    for first_second in round_order(warmup):
        for side in first_second:
            if setup is not None:
                setup(side)
            fns[side]()
    n = inner if inner is not None else _calibrate(fns, sync, min_time, setup=setup)
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    probed: dict[str, list[float]] = {f"{s}_{p.name}_per_call": [] for s in SIDES for p in probes}
    order = round_order(rounds)
    for first_second in order:
        for side in first_second:
            if setup is not None:
                setup(side)
            fn = fns[side]
            sync()
            tokens = [p.start() for p in probes]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            elapsed = time.perf_counter() - t0
            for p, tok in zip(probes, tokens, strict=True):
                probed[f"{side}_{p.name}_per_call"].append(p.stop(tok) / n)
            times[side].append(elapsed / (n * units_per_call))
    load_after = os.getloadavg()[0]
    stats = ratio_stats(
        times["candidate"], times["peer"], confidence=confidence, resamples=resamples, seed=seed
    )
    extra = {k: float(np.median(v)) for k, v in probed.items()}
    return PairedResult(
        candidate_s=times["candidate"],
        peer_s=times["peer"],
        order=order,
        stats=stats,
        inner=n,
        load_before=load_before,
        load_after=load_after,
        cpus=os.cpu_count() or 0,
        device=device_name(dev),
        extra=extra,
        probe_rounds=probed,
    )


# ------------------------------------------------------------------------------- CSV schema


@dataclass
class RatioRow:
    """One paired comparison; the CSV schema shared by every ratio benchmark.

    ``median_ratio`` = candidate time / peer time (below 1: the candidate is faster), with
    its bootstrap interval [ci_low, ci_high]. Times are per call (or per unit of work, see
    ``paired``'s ``units_per_call``). ``extra`` holds probe results and case metadata as a
    JSON object in one column, so new metrics never change the schema.
    """

    benchmark: str
    case: str
    candidate: str
    peer: str
    rounds: int
    inner: int
    median_ratio: float
    ci_low: float
    ci_high: float
    candidate_ms: float
    candidate_p20_ms: float
    candidate_p80_ms: float
    peer_ms: float
    peer_p20_ms: float
    peer_p80_ms: float
    extra: dict[str, float]
    load_before: float
    load_after: float
    cpus: int
    device: str
    label: str
    torch: str
    triton: str
    engine: str
    date: str
    note: str


RATIO_COLUMNS = [f.name for f in fields(RatioRow)]
_INT_COLUMNS = {"rounds", "inner", "cpus"}
_FLOAT_COLUMNS = {f.name for f in fields(RatioRow) if f.type in ("float", float)}


def write_ratio_csv(rows: Iterable[RatioRow], path: Path) -> None:
    """Write ``rows`` with the shared ratio schema (``extra`` as a JSON object)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=RATIO_COLUMNS)
        writer.writeheader()
        for row in rows:
            record = asdict(row)
            record["extra"] = json.dumps(row.extra, sort_keys=True)
            writer.writerow(record)


def read_ratio_csv(path: Path) -> list[RatioRow]:
    """Read a file written by ``write_ratio_csv``; a missing or unknown column is an error."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames != RATIO_COLUMNS:
            raise ValueError(
                f"{path}: columns {reader.fieldnames} are not the ratio schema {RATIO_COLUMNS}"
            )
        rows = []
        for record in reader:
            values: dict[str, Any] = dict(record)
            for name in _INT_COLUMNS:
                values[name] = int(values[name])
            for name in _FLOAT_COLUMNS:
                values[name] = float(values[name])
            values["extra"] = json.loads(values["extra"])
            rows.append(RatioRow(**values))
    return rows


def summary_line(row: RatioRow) -> str:
    """``case vs peer: 1.27x [1.21, 1.33] (31 rounds, load 1.9->2.1)``."""
    return (
        f"{row.case} {row.candidate} vs {row.peer}: {row.median_ratio:.2f}x "
        f"[{row.ci_low:.2f}, {row.ci_high:.2f}] ({row.rounds} rounds, "
        f"load {row.load_before:.1f}->{row.load_after:.1f})"
    )


def whole_step_graph(body: Callable[[], None], opt: torch.optim.Optimizer,
                     warmup: int = 3) -> torch.cuda.CUDAGraph:
    """PyTorch's whole-network capture recipe, the peer a careful user writes at batch 1:
    ``warmup`` steps of ``body`` (forward, backward, ``opt.step()``) on a side stream, each
    from gradients set to None, then one capture from None gradients, so that backward
    allocates them in the graph's pool and every replay's first backward writes them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def gpu_ratio_arguments(ap: argparse.ArgumentParser, csv_name: str) -> None:
    """``--out``, ``--rounds``, ``--warmup``, ``--min-time``, ``--quick``, ``--label``: the
    options of a GPU ratio benchmark (run with :func:`run_gpu_ratios`)."""
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for {csv_name}")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds per case")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each side per case")
    ap.add_argument("--min-time", type=float, default=0.1,
                    help="seconds the faster side's timed block lasts (sets calls per block)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, short blocks: a smoke run")
    ap.add_argument("--label", default="", help="machine label for the CSV")


def run_gpu_ratios(
    ap: argparse.ArgumentParser, args: argparse.Namespace, name: str,
    measure: Callable[..., list[RatioRow]], quick_min_time: float,
) -> int:
    """Run ``measure(device, rounds=, warmup=, min_time=, label=)`` on the GPU with
    :func:`gpu_ratio_arguments`' options and write ``OUT/<name>.csv``; without a GPU say so
    and write nothing (exit code 0: a CPU machine is not an error)."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing "
              "measured, nothing written")
        return 0
    if args.quick:
        args.rounds, args.warmup, args.min_time = 3, 1, quick_min_time
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    rows = measure(torch.device("cuda"), rounds=args.rounds, warmup=args.warmup,
                   min_time=args.min_time, label=args.label)
    path = args.out / f"{name}.csv"
    write_ratio_csv(rows, path)
    print(f"wrote {path}")
    return 0


def size_arguments(ap: argparse.ArgumentParser, params: int, rounds: int = 15) -> None:
    """``--out``, ``--params``, ``--rounds``, ``--quick`` (1M params, 3 rounds), ``--label``:
    the options of a one-size CPU ratio benchmark (read back with :func:`size_and_rounds`)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", type=int, default=params)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--quick", action="store_true", help="1M params, 3 rounds")
    ap.add_argument("--label", default="")


def size_and_rounds(args: argparse.Namespace) -> tuple[int, int]:
    """(params, rounds) of :func:`size_arguments`' options."""
    return (2**20, 3) if args.quick else (args.params, args.rounds)
