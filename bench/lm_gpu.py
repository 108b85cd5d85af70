"""A real transformer end to end on one GPU: the project's GPT at GPT-2-small width, the
engine's captured pipelines against the same model trained by a plain PyTorch loop.

The question: on a model people train, does a pipeline on one GPU cost what the best plain
loop costs? The model is ``engine.demo.models.gpt`` (what ``python -m engine --task lm`` trains):
token and position embeddings, ``--layers`` pre-norm transformer blocks (causal
self-attention, then a 4x MLP), a final LayerNorm and an LM head tied to the token embedding.
Default size GPT-2 small: d=768, 12 heads, 12 blocks, vocabulary 50304 (GPT-2's 50257 padded
to a multiple of 64), sequences of 512 tokens (~124 M parameters). bf16 autocast, fp32
weights, AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1), ``F.cross_entropy`` against
random token ids (throughput does not depend on the data).

Parts (``--parts``, default all, in this order; every pair through bench/harness.py:
alternating paired rounds, median time ratio with a 95 % interval, ``torch.cuda.synchronize``
around every block):

* ``sync``: engine 1f1b and gpipe, S=4 stages (cut where the forward FLOPs balance: the head
  is ~5 blocks' worth), M=8 micro-batches of ``--batch`` sequences,
  ``cuda_graphs="program"`` (the whole step replayed from one CUDA graph), stage streams as
  ``cuda_streams=None`` decides, engine.optim.AdamW (fused kernels), ``checkpoint="never"``,
  ``on_nonfinite="skip_update"``; against the unsplit model trained by a plain micro-batch
  accumulation loop (per step M forwards under autocast, backwards of loss/M, one fused
  ``torch.optim.AdamW`` step) captured as one CUDA graph (``harness.whole_step_graph``) --
  the same math (tests/bench/test_bench_lm_gpu.py checks one engine step against one loop step
  on CPU). Goals: captured engine <= 1.05x the captured loop's step time at <= 1.1x its
  peak memory.
* ``pb``: pb with spike compensation and linear weight prediction (AdamW with
  ``spike_compensation=True, prediction="linear"``, ``weight_prediction="lwp"``) at batch 1
  (one sequence per micro-batch, M=8 per call), captured, against the per-sample loop (one
  sequence's forward, backward and fused AdamW step) with each sample's step one CUDA graph
  replay. Different math by design (delayed pb against plain per-sample AdamW): the ratio
  prices the runtime. Goal: <= 1.0x the graphed loop.
* ``compile``: the accumulation loop with ``torch.compile(model)`` (default mode, fused
  AdamW outside the compiled region), against the captured loop and against both captured
  engine schedules -- only where it builds within ``--compile-budget`` seconds (otherwise
  skipped with the reason printed).

Per side: tokens/s (the tokens of one call over its median time) and peak memory
(``torch.cuda.max_memory_allocated`` from just before the side is built through its
warm-up, capture and first replays, less what was allocated before it: the side's own
footprint, other sides alive or not; the peak statistics are reset between sides). Each row's
``extra`` holds both sides' tokens/s and peak MiB, the memory ratio, and the goals, which are
printed next to the measured ratios. Rows go to ``OUT/lm_gpu-<device>.csv`` (the ratio schema,
``<device>`` e.g. ``h100``), rewritten after every pair, so a run stopped at its time budget
(SIGINT from ``timeout``) keeps what it measured. A side that fails (an error, or a capture
that does not replay) is reported with its reason, its pairs are skipped, the other parts
still run, and the exit status is 1.

Cost of the default run on one H100 -- an ESTIMATE, not a measurement:
forward FLOPs per token: matmuls 2 x (85.0 M block + 38.6 M head) parameters = 247 M,
attention 12 x 4 x 512 x 768 = 18.9 M (the full masked T x T is computed); x 3 with the
backward: ~800 MFLOP a token. A synchronous step is 8 x 4 x 512 = 16384 tokens = 13.1 TFLOP:
44-87 ms at 150-300 TFLOP/s effective bf16. A pb call is 8 sequences one at a time, 3.3 TFLOP
at batch 512 tokens (~100-200 TFLOP/s: 16-33 ms) plus 8 AdamW steps over 124 M parameters
(~28 B a parameter read and written, ~1.2 ms each at ~3 TB/s: ~10 ms): 25-45 ms. A pair is
2 x 3 warm-up + 6 calibration + 2 x 11 rounds x (2-4 calls a block, to fill --min-time 0.1 s)
= 56-100 calls: ~3-5 s; 6 pairs ~20-30 s. Set-up: ~10 s start; 3-8 s a side built (six
builds: the two loops, the three engine sides, and gpipe once more for the compile pairs,
since it is freed after its own pair), the first Triton compiles of the AdamW kernels 10-20 s,
torch.compile of the model 40-90 s (capped by --compile-budget 90). Whole run: ~100-200 s at
11 rounds, sized for ~4 minutes. Memory (estimate): ~2 GB of weights, gradients
and AdamW state per side; saved activations ~0.75 GB a sequence (the T x T attention
probabilities in fp32 dominate), so the loop holds ~3 GB of them (one micro-batch), 1f1b
~7 GB (2.5 micro-batches on average), gpipe ~23 GB (all 8): the memory goal compares 1f1b's and
gpipe's in-flight activations with the loop's one micro-batch.

    python bench/lm_gpu.py --out bench/results --rounds 11          # GPU, the default run
    python bench/lm_gpu.py --quick --out /tmp/lm                    # GPU smoke run (3 rounds)
    python bench/lm_gpu.py --dry-run --out /tmp/lm                  # CPU: tiny width, eager

On the CPU (``--dry-run``, or ``--device cpu``) the sizes default to a tiny model (d=32,
4 heads, 2 blocks, 16 tokens, vocabulary 64, 1 sequence per micro-batch), CUDA graphs need a
GPU so every captured side runs as its eager twin (the same calls without the graph; rows
say "eager"), and torch.compile is skipped unless ``--compile on``. Peak memory is then
not measured (empty). Without a GPU and without ``--dry-run``/``--device cpu`` it says so
and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name  # noqa: E402
from harness import (  # noqa: E402
    RatioRow, gpu_ratio_arguments, paired, summary_line, whole_step_graph, write_ratio_csv,
)

import engine  # noqa: E402
import engine.optim  # noqa: E402
from engine.demo.models import gpt, split_layers  # noqa: E402

NAME = "lm_gpu"
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
SCHEDULES = ("1f1b", "gpipe")
PARTS = ("sync", "pb", "compile")
POOL = 4  # mini-batches each side cycles through (made before timing)
GOAL_SYNC_TIME, GOAL_SYNC_MEMORY, GOAL_PB_TIME = 1.05, 1.1, 1.0
#: steps an engine side trains before timing: captured, the first step, warm-up, the capture
#: and replays (pb: until its windows repeat); eager (the CPU check), the first steps only
WARM_STEPS = {("sync", True): 4, ("pb", True): 16, ("sync", False): 1, ("pb", False): 2}


@dataclass(frozen=True)
class LM:
    """The model and the step: ``layers`` transformer blocks of width ``d`` (plus the
    embedding and the tied head), sequences of ``seq`` tokens, ``batch`` sequences per
    micro-batch, ``chunks`` micro-batches per step, ``stages`` pipeline stages."""

    d: int = 768
    heads: int = 12
    layers: int = 12
    seq: int = 512
    vocab: int = 50304
    batch: int = 4
    chunks: int = 8
    stages: int = 4

    def model(self) -> nn.Sequential:
        """The whole model, the same initial weights every call."""
        torch.manual_seed(0)
        return gpt(self.vocab, self.seq, self.layers + 2, self.d, self.heads, tie=True)

    def layer_flops(self) -> list[float]:
        """Forward FLOPs per token of each layer of :meth:`model` (embedding: a gather)."""
        block = 2 * 12 * self.d**2 + 4 * self.seq * self.d
        return [float(self.d), *([float(block)] * self.layers), 2.0 * self.vocab * self.d]

    def balance(self) -> list[int]:
        """Layers per stage, contiguous, minimising the largest stage's forward FLOPs."""
        return min_max_balance(self.layer_flops(), self.stages)

    def tokens(self, sequences: int) -> int:
        return sequences * self.seq

    def describe(self) -> str:
        return (f"gpt d={self.d} heads={self.heads} blocks={self.layers} seq={self.seq} "
                f"vocab={self.vocab}")

    def extra(self) -> dict[str, Any]:
        return {**asdict(self), "balance": "/".join(map(str, self.balance()))}


#: the CPU check's sizes (--dry-run / --device cpu), each overridable on the command line
TINY = LM(d=32, heads=4, layers=2, seq=16, vocab=64, batch=1)


def min_max_balance(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` non-empty runs whose largest sum is the
    smallest possible (ties: the earliest cuts)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"lm_gpu: cannot cut {n} layers into {stages} stages (1 to {n})")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[s][i]: the smallest largest-stage cost of the first i layers in s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def device_slug(device: torch.device) -> str:
    """The device part of the CSV's name: ``h100`` for "NVIDIA H100 80GB HBM3", ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = device_name(device).lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


# ------------------------------------------------------------------------------- the sides


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def torch_adamw(params: Any, device: torch.device) -> torch.optim.Optimizer:
    """The loops' optimizer: torch's fused AdamW on a GPU (its fastest; ``capturable=True``
    because torch refuses to capture an Adam step without it, and the fused kernel keeps its
    step count on the device either way), the single-tensor path on the CPU (which
    engine.optim's reference path matches op for op)."""
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 fused=True, capturable=True)
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                             foreach=False)


def engine_adamw(**mitigations: Any) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda p: engine.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS,
                                        weight_decay=WEIGHT_DECAY, **mitigations)


def pipeline(cfg: LM, schedule: str, device: torch.device, *, captured: bool) -> engine.Pipeline:
    """An engine side: 1f1b/gpipe (M micro-batches of cfg.batch sequences) or pb at batch 1
    with SC + LWP; ``captured``: ``cuda_graphs="program"`` (a GPU only)."""
    parts = [p.to(device) for p in split_layers(cfg.model(), cfg.balance())]
    kw: dict[str, Any] = {}
    opt = engine_adamw()
    if schedule == "pb":
        opt = engine_adamw(spike_compensation=True, prediction="linear")
        kw["weight_prediction"] = "lwp"
    return engine.Pipeline(
        parts, schedule=schedule, chunks=cfg.chunks, loss_fn=F.cross_entropy, optimizer=opt,
        checkpoint="never", on_nonfinite="skip_update", autocast=torch.bfloat16,
        cuda_graphs="program" if captured else False, **kw,
    )


class AccumulationLoop:
    """The plain loop: per step M micro-batches, each forward under autocast and a backward
    of loss/M, then one AdamW step. ``graph``: the whole step captured as one CUDA graph
    (PyTorch's whole-network recipe) and replayed after one copy of the batch into its
    static input; otherwise eager, from gradients set to None each step (so ``net`` may be a
    ``torch.compile`` of the model)."""

    def __init__(self, net: nn.Module, x: Tensor, y: Tensor, chunks: int, *, graph: bool) -> None:
        self.net, self.chunks, self.device = net, chunks, x.device
        self.opt = torch_adamw(net.parameters(), x.device)
        self.x, self.y = x.clone(), y.clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self.graph = whole_step_graph(self._body, self.opt)

    def _body(self) -> None:
        for xm, ym in zip(self.x.chunk(self.chunks), self.y.chunk(self.chunks), strict=True):
            with autocast(self.device):
                loss = F.cross_entropy(self.net(xm), ym) / self.chunks
            loss.backward()
        self.opt.step()

    def __call__(self, x: Tensor, y: Tensor) -> None:
        self.x.copy_(x)
        self.y.copy_(y)
        if self.graph is None:
            self.opt.zero_grad(set_to_none=True)
            self._body()
        else:  # grads were None at capture: each replay's first backward writes them
            self.graph.replay()


class SampleLoop:
    """Plain per-sample AdamW on the unsplit model: per sequence a forward under autocast,
    a backward and a step; ``graph``: each sample's step one CUDA graph replay."""

    def __init__(self, net: nn.Module, x: Tensor, y: Tensor, *, graph: bool) -> None:
        self.net, self.device = net, x.device
        self.opt = torch_adamw(net.parameters(), x.device)
        self.x, self.y = x[:1].clone(), y[:1].clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self.graph = whole_step_graph(self._body, self.opt)

    def _body(self) -> None:
        with autocast(self.device):
            loss = F.cross_entropy(self.net(self.x), self.y)
        loss.backward()
        self.opt.step()

    def __call__(self, x: Tensor, y: Tensor) -> None:
        for k in range(x.shape[0]):
            self.x.copy_(x[k:k + 1])
            self.y.copy_(y[k:k + 1])
            if self.graph is None:
                self.opt.zero_grad(set_to_none=True)
                self._body()
            else:
                self.graph.replay()


def cycling(fn: Callable[[Tensor, Tensor], object], data: Sequence[tuple[Tensor, Tensor]]
            ) -> Callable[[], object]:
    """A zero-argument call that trains on the next mini-batch of the pool."""
    state = {"k": 0}

    def step() -> object:
        x, y = data[state["k"] % len(data)]
        state["k"] += 1
        return fn(x, y)

    return step


def batches(cfg: LM, sequences: int, device: torch.device, seed: int
            ) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, cfg.vocab, (sequences, cfg.seq), generator=g).to(device)
                  for _ in range(2)) for _ in range(POOL)]  # type: ignore[misc]


class CompileBudgetExceeded(BaseException):
    """torch.compile did not build within its budget (a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` inside torch.compile swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CompileBudgetExceeded` in the main thread after ``seconds`` (SIGALRM;
    no limit where the platform or thread has no such signal)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(_sig: int, _frame: object) -> None:
        raise CompileBudgetExceeded(f"did not build within --compile-budget {seconds:g} s")

    try:
        old = signal.signal(signal.SIGALRM, expire)
    except ValueError:  # not the main thread
        yield
        return
    t0 = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer > 0:  # an alarm someone else had set (e.g. a test timeout) goes on
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 1e-3))


# ------------------------------------------------------------------------------- the run


@dataclass
class Side:
    """A built side: its call, the tokens one call trains, its own peak memory (MiB, None
    on the CPU) and facts for the CSV."""

    call: Callable[[], object]
    label: str
    tokens: int
    peak_mib: float | None
    facts: dict[str, Any]
    holds: Any = None  # the pipeline or loop, kept alive with the call


class SideFailed(Exception):
    """A side could not be built, or its capture does not replay."""


def measured_build(device: torch.device, build: Callable[[], Side]) -> Side:
    """Build (and warm) a side, recording its own peak allocation: what it allocated at
    most above what was allocated before it."""
    if device.type != "cuda":
        return build()
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    side = build()
    torch.cuda.synchronize(device)
    side.peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    side.facts["reserved_growth_mib"] = (torch.cuda.memory_reserved(device) - reserved) / 2**20
    return side


def check_replaying(pipe: engine.Pipeline, what: str) -> dict[str, Any]:
    cap = pipe.stats()["capture"]
    if cap["captures"] < 1 or cap["replays"] < 1:
        raise SideFailed(f"{what}: the capture does not replay: {cap}")
    return {"captures": cap["captures"], "replays": cap["replays"]}


class Run:
    """The parts of one run on one device, their sides built on demand (each built once;
    a failure is remembered with its reason) and the rows so far."""

    def __init__(self, device: torch.device, cfg: LM, *, rounds: int, warmup: int,
                 min_time: float, label: str, compile_mode: str, compile_budget: float,
                 log: Callable[[str], None], done: Callable[[list[RatioRow]], None] | None) -> None:
        self.device, self.cfg = device, cfg
        self.gpu = device.type == "cuda"
        self.timing = {"rounds": rounds, "warmup": warmup, "min_time": min_time}
        self.label, self.log, self.done = label, log, done
        self.compile_mode, self.compile_budget = compile_mode, compile_budget
        self.where = "one GPU" if self.gpu else "CPU check"
        self.sync_data = batches(cfg, cfg.batch * cfg.chunks, device, seed=1)
        self.pb_data = batches(cfg, cfg.chunks, device, seed=2)
        self.sides: dict[str, Side] = {}
        self.peaks: dict[str, float | None] = {}
        self.failures: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.rows: list[RatioRow] = []

    # ---- sides

    def _build(self, key: str) -> Side:
        cfg, dev, cap = self.cfg, self.device, self.gpu
        mode = "captured" if cap else "eager"
        if key in SCHEDULES or key == "pb":
            data = self.pb_data if key == "pb" else self.sync_data
            steps = WARM_STEPS["pb" if key == "pb" else "sync", cap]
            pipe = pipeline(cfg, key, dev, captured=cap)
            go = cycling(pipe.step, data)
            for _ in range(steps):
                go()
            facts: dict[str, Any] = {"stage_streams": pipe.parts.streams.separate}
            if cap:
                facts.update(check_replaying(pipe, f"engine {key}"))
            label = f"engine {key} {mode}" + (" batch 1, SC+LWP" if key == "pb" else "")
            return Side(go, label, cfg.tokens(data[0][0].shape[0]), None, facts, pipe)
        if key == "loop":
            x, y = self.sync_data[0]
            loop = AccumulationLoop(cfg.model().to(dev), x, y, cfg.chunks, graph=cap)
            go = cycling(loop, self.sync_data)
            go()
            return Side(go, f"plain loop {mode}", cfg.tokens(x.shape[0]), None, {}, loop)
        if key == "sample loop":
            x, y = self.pb_data[0]
            loop = SampleLoop(cfg.model().to(dev), x, y, graph=cap)
            go = cycling(loop, self.pb_data)
            go()
            return Side(go, "per-sample loop " + ("graphed" if cap else "eager"),
                        cfg.tokens(x.shape[0]), None, {}, loop)
        if key == "compiled loop":
            return self._build_compiled()
        raise KeyError(key)

    def _build_compiled(self) -> Side:
        x, y = self.sync_data[0]
        net = self.cfg.model().to(self.device)
        t0 = time.perf_counter()
        try:
            with time_limit(self.compile_budget):
                loop = AccumulationLoop(torch.compile(net), x, y, self.cfg.chunks, graph=False)
                go = cycling(loop, self.sync_data)
                for _ in range(2):  # the forward's and the backward's graphs, then a rerun
                    go()
                if self.gpu:
                    torch.cuda.synchronize(self.device)
        except CompileBudgetExceeded:
            if "torch._dynamo" in sys.modules:  # drop what the interrupted build left
                sys.modules["torch._dynamo"].reset()
            raise
        built = time.perf_counter() - t0
        self.log(f"torch.compile built the loop in {built:.1f} s")
        return Side(go, "plain loop torch.compile", self.cfg.tokens(x.shape[0]), None,
                    {"compile_s": round(built, 1)}, loop)

    def side(self, key: str) -> Side | None:
        """The side, built now if it is not alive; None (reason logged once) if it fails."""
        if key in self.failures or key in self.skipped:
            return None
        if key not in self.sides:
            try:
                side = measured_build(self.device, lambda: self._build(key))
            except (Exception, CompileBudgetExceeded) as exc:  # reported; the run goes on
                reason = f"{type(exc).__name__}: {exc}"
                over_budget = isinstance(exc, CompileBudgetExceeded)
                (self.skipped if over_budget else self.failures)[key] = reason
                self.log(f"{'SKIPPED' if key in self.skipped else 'FAILED'} {key}: {reason}")
                self.free(key)
                return None
            if key not in self.peaks:
                self.peaks[key] = side.peak_mib
            side.peak_mib = self.peaks[key]  # a rebuilt side reports its first build
            self.sides[key] = side
            if side.peak_mib is not None:
                self.log(f"{side.label}: peak {side.peak_mib:.0f} MiB ({side.facts})")
        return self.sides[key]

    def free(self, *keys: str) -> None:
        for key in keys:
            self.sides.pop(key, None)
        gc.collect()
        if self.gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- pairs

    def pair(self, cand_key: str, peer_key: str, case: str, goals: dict[str, float]) -> None:
        cand = self.side(cand_key)
        peer = self.side(peer_key) if cand is not None else None
        if cand is None or peer is None:
            self.log(f"skipped pair {cand_key} vs {peer_key}: no {peer_key if cand else cand_key}")
            return
        res = paired(cand.call, peer.call, device=self.device,
                     **self.timing)  # type: ignore[arg-type]
        ratio_mem = (cand.peak_mib / peer.peak_mib
                     if cand.peak_mib is not None and peer.peak_mib else None)
        row = res.row(
            NAME, case, cand.label, peer.label, label=self.label,
            note=("engine 1f1b/gpipe and the loops: the same math; pb vs the per-sample loop: "
                  "different math by design"),
            extra={**self.cfg.extra(), "part": "pb" if cand_key == "pb" else "sync",
                   "candidate_tokens_per_call": cand.tokens, "peer_tokens_per_call": peer.tokens,
                   "candidate_peak_mib": cand.peak_mib, "peer_peak_mib": peer.peak_mib,
                   "memory_ratio": ratio_mem,
                   **{f"candidate_{k}": v for k, v in cand.facts.items()},
                   **{f"peer_{k}": v for k, v in peer.facts.items()},
                   **{f"goal_{k}": v for k, v in goals.items()}},
        )
        c_s, p_s = row.candidate_ms / 1e3, row.peer_ms / 1e3
        row.extra["candidate_tokens_per_s"] = cand.tokens / c_s if c_s > 0 else None
        row.extra["peer_tokens_per_s"] = peer.tokens / p_s if p_s > 0 else None
        self.rows.append(row)
        self.log(summary_line(row))
        self.log("    " + goal_line(row))
        if self.done is not None:
            self.done(list(self.rows))

    # ---- parts

    def part_sync(self) -> None:
        for schedule in SCHEDULES:
            self.pair(schedule, "loop", self.case(f"{schedule} S={self.cfg.stages} "
                                                  f"M={self.cfg.chunks}", self.cfg.batch),
                      {"time_ratio": GOAL_SYNC_TIME, "memory_ratio": GOAL_SYNC_MEMORY})
        self.free("gpipe")  # it holds all M micro-batches' activations; 1f1b and the loop
        # stay for the compile pairs

    def part_pb(self) -> None:
        self.pair("pb", "sample loop", self.case(f"pb batch 1 S={self.cfg.stages} "
                                                 f"M={self.cfg.chunks}", 1),
                  {"time_ratio": GOAL_PB_TIME})
        self.free("pb", "sample loop")

    def part_compile(self) -> None:
        if self.compile_mode == "off" or (self.compile_mode == "auto" and not self.gpu):
            why = ("--compile off" if self.compile_mode == "off" else
                   "not on a GPU (torch.compile costs ~25 s on a CPU; --compile on tries it)")
            self.skipped["compiled loop"] = why
            self.log(f"SKIPPED torch.compile: {why}")
            return
        if self.side("compiled loop") is None:  # (then no engine side is built for it)
            return
        case = self.case(f"loop compiled M={self.cfg.chunks}", self.cfg.batch)
        self.pair("compiled loop", "loop", case, {})
        for schedule in SCHEDULES:
            self.pair(schedule, "compiled loop",
                      self.case(f"{schedule} S={self.cfg.stages} M={self.cfg.chunks}",
                                self.cfg.batch), {})
            self.free(schedule)

    def case(self, what: str, sequences: int) -> str:
        return f"{what} {self.cfg.describe()} batch {sequences}x{self.cfg.seq} {self.where}"


def goal_line(row: RatioRow) -> str:
    """The measured ratios next to the goals (time: met when the whole interval is at or
    under the goal, missed when it is over, open otherwise)."""
    e = row.extra
    parts = [f"{row.candidate_ms:.2f} vs {row.peer_ms:.2f} ms a call"]
    if e.get("candidate_tokens_per_s") and e.get("peer_tokens_per_s"):
        parts.append(f"{e['candidate_tokens_per_s']:,.0f} vs {e['peer_tokens_per_s']:,.0f} "
                     "tokens/s")
    goal = e.get("goal_time_ratio")
    if goal is not None:
        verdict = ("met" if row.ci_high <= goal else "missed" if row.ci_low > goal else "open")
        parts.append(f"time {row.median_ratio:.3f}x, goal <= {goal}x: {verdict}")
    mem = e.get("memory_ratio")
    if mem is not None:
        parts.append(f"peak {e['candidate_peak_mib']:.0f} vs {e['peer_peak_mib']:.0f} MiB")
        mgoal = e.get("goal_memory_ratio")
        verdict = "" if mgoal is None else f", goal <= {mgoal}x: " + ("met" if mem <= mgoal
                                                                      else "missed")
        parts.append(f"memory {mem:.2f}x{verdict}")
    elif e.get("goal_memory_ratio") is not None:
        parts.append(f"memory goal <= {e['goal_memory_ratio']}x: not measured (no GPU)")
    return "; ".join(parts)


def run(device: torch.device, cfg: LM = LM(), *, parts: Sequence[str] = PARTS,
        rounds: int = 11, warmup: int = 3, min_time: float = 0.1, label: str = "",
        compile_mode: str = "auto", compile_budget: float = 90.0,
        log: Callable[[str], None] = print,
        done: Callable[[list[RatioRow]], None] | None = None) -> Run:
    """Every pair of ``parts`` on ``device`` (captured sides on a GPU, their eager twins on
    the CPU). ``done`` gets every row so far after each pair (the CLI rewrites its CSV)."""
    r = Run(device, cfg, rounds=rounds, warmup=warmup, min_time=min_time, label=label,
            compile_mode=compile_mode, compile_budget=compile_budget, log=log, done=done)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # the CPU check's tensors are tiny: more threads only spin
        torch.set_num_threads(1)
    try:
        for part in (p for p in PARTS if p in parts):
            getattr(r, f"part_{part}")()
    finally:
        r.free(*list(r.sides))
        torch.set_num_threads(threads)
    return r


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu_ratio_arguments(ap, f"{NAME}-<device>.csv")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default) or cpu: the CPU check (eager twins, tiny sizes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU check: --device cpu --quick at the tiny sizes")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="which parts to run (in the order sync, pb, compile)")
    for opt, what in (("d", "model width"), ("heads", "attention heads"),
                      ("layers", "transformer blocks"), ("seq", "tokens per sequence"),
                      ("vocab", "vocabulary"), ("batch", "sequences per micro-batch (sync)")):
        ap.add_argument(f"--{opt}", type=int, default=None,
                        help=f"{what} (GPU default {getattr(LM(), opt)}, CPU {getattr(TINY, opt)})")
    ap.add_argument("--compile", dest="compile_mode", choices=("auto", "on", "off"),
                    default="auto", help="torch.compile side: auto = on a GPU only")
    ap.add_argument("--compile-budget", type=float, default=90.0,
                    help="seconds torch.compile may take to build, else skipped (0: no limit)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.quick = "cpu", True
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{NAME}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing "
              "measured, nothing written (--dry-run checks the script on the CPU)")
        return 0
    if args.quick:
        args.rounds, args.warmup, args.min_time = 3, 1, 0.02
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    device = torch.device(args.device)
    base = LM() if device.type == "cuda" else TINY
    sizes = ("d", "heads", "layers", "seq", "vocab", "batch")
    cfg = replace(base, **{k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
    for k in sizes:
        if getattr(cfg, k) < 1:
            ap.error(f"--{k} {getattr(cfg, k)} must be >= 1")
    if cfg.d % cfg.heads:
        ap.error(f"--d {cfg.d} must be a multiple of --heads {cfg.heads}")
    if cfg.layers + 2 < cfg.stages:
        ap.error(f"--layers {cfg.layers}: {cfg.stages} stages need at least "
                 f"{cfg.stages - 2} blocks")
    path = args.out / f"{NAME}-{device_slug(device)}.csv"
    print(f"{NAME}: {cfg.describe()} batch {cfg.batch} M={cfg.chunks} S={cfg.stages} "
          f"(balance {cfg.balance()}) on {device_name(device)}, {args.rounds} rounds")
    written: list[int] = []

    def done(rows: list[RatioRow]) -> None:
        write_ratio_csv(rows, path)
        written[:] = [len(rows)]

    try:
        r = run(device, cfg, parts=args.parts, rounds=args.rounds, warmup=args.warmup,
                min_time=args.min_time, label=args.label, compile_mode=args.compile_mode,
                compile_budget=args.compile_budget, done=done)
    except KeyboardInterrupt:
        print(f"{NAME}: interrupted (time budget?); {path} holds the "
              f"{written[0] if written else 0} rows measured before")
        return 130
    if written:
        print(f"wrote {path} ({written[0]} rows)")
    else:
        print(f"{NAME}: no pair measured; nothing written")
    for key, why in {**r.skipped}.items():
        print(f"skipped {key}: {why}")
    for key, why in r.failures.items():
        print(f"FAILED {key}: {why}")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
