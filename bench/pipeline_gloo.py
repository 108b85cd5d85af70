"""End-to-end pipeline throughput over gloo: engine vs torch.distributed.pipelining, and async
schedules vs GPipe against the theoretical M/(M+S-1).

Run under torchrun, one process per stage (rank 0 writes the results):

    torchrun --standalone --nproc-per-node 4 bench/pipeline_gloo.py --out bench/results --label "CPU, 2 cores"

(``python bench/pipeline_gloo.py --out DIR`` launches itself that way, with ``--ranks`` ranks.)

What is compared, in one run on the same machine, the same model (an MLP cut into S equal
stages), the same micro-batches and the same optimizer (SGD with momentum):

* ``vs_torch``: ``engine`` ``gpipe`` / ``1f1b`` / ``zbh1`` vs torch's ``ScheduleGPipe`` /
  ``Schedule1F1B`` / ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB-H1's order);
  ``engine`` ``interleaved`` with ``--virtual`` v stages per rank (S*v stage modules) vs torch's
  ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` on the same S*v modules;
  ``looped-bfs``: ``engine`` ``looped_bfs`` vs torch's ``ScheduleLoopedBFS`` (same S*v modules).
  ``zbv`` / ``dualpipev``: ``engine`` ``zbv`` / ``dualpipev`` programs (2S stage modules placed
  as a V: rank r holds stages r and 2S-1-r) vs torch's ``ScheduleZBVZeroBubble`` /
  ``ScheduleDualPipeV`` on the same modules and placement (not in the default list; DualPipeV
  needs M >= 2S). No activation recomputation on either side.
  Each side runs as its users get it: torch's schedules on the default process group, the
  engine on groups of its own whose gloo network thread it runs under SCHED_BATCH
  (engine/runtime/ranks/transport/groups.py), its neighbours' messages through shared-memory
  rings when they share the host (transport/shm.py; ``ENGINE_SHM=0``: gloo for everything).
  ``--peer-net-batch`` gives torch's side the scheduling too.
* ``async_vs_gpipe``: ``engine`` ``pipedream`` / ``2bw`` / ``pb`` vs ``engine`` ``gpipe``, next
  to the theoretical time ratio M/(M+S-1) (``extra.theory_ratio``): GPipe's bubble per
  mini-batch when every stage takes the same time and communication is free. Async schedules
  run ``--steps`` mini-batches without flushing, then one flush (inside the timed block).
* ``tp_cost`` (only with ``--cases tp``, 4 ranks): tensor parallelism's cost -- ``engine``
  ``1f1b`` on a TP=2 x PP=2 mesh (each stage's MLP blocks sharded column/row-wise by torch's
  ``parallelize_module``: two activation all-reduces per block and pass) vs TP=1 x PP=2 on the
  same 4 processes (a pp x dp mesh whose two replicas each run the whole batch: the same
  process count and per-replica work, plus one gradient all-reduce per update). Not a speed
  goal: on a CPU the sharded matmuls are too small to gain; it says what the collectives cost.
* ``flags_cost`` (only with ``--cases pb-skip-update``): ``engine`` ``pb`` with
  ``on_nonfinite="skip_update"`` (each gradient carries its micro-batch's non-finite flag, one
  more gloo message) vs the same run with ``"raise"`` (one loss check per step), both with
  engine.optim.SGD.

Timing: every comparison is a paired measurement through bench/harness.py. Inside each rank
the two providers alternate (AB, BA, ...) round by round; a round times one block of
``--steps`` mini-batches of each, bracketed by barriers so that a block spans the whole
pipeline; rank 0 takes the per-round time ratios candidate/peer and reports their median with
a 95 % bootstrap interval (below 1: the candidate is faster). On a machine with fewer cores
than processes (the CI box: 2 cores, 4 ranks) the ranks time-share the cores, so the async
speed-ups are bounded by the core count, not by the schedule; the CSV's ``note`` says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_name, under_torchrun  # noqa: E402
from harness import ProcessCPU, RatioRow, ThreadCPU, paired, summary_line, write_ratio_csv  # noqa: E402
from outputs import DEFAULT_OUT  # noqa: E402


def stage_module(s: int, width: int, layers: int) -> nn.Module:
    torch.manual_seed(s)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def data(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
        for _ in range(steps)
    ]


class EngineRunner:
    """``virtual`` v > 1: ``schedule="interleaved"`` over S*v stage modules, v per rank."""

    def __init__(
        self, schedule: str, S: int, M: int, width: int, layers: int, timeout: float,
        virtual: int = 1, on_nonfinite: str | None = None,
    ) -> None:
        import engine.optim
        from engine import Pipeline
        from engine import schedule as es

        opt = torch.optim.SGD if on_nonfinite is None else engine.optim.SGD
        program: object = schedule
        if schedule in ("zbv", "dualpipev"):  # a program: 2 stages per rank, placed as a V
            program, virtual = getattr(es, schedule)(S, M), 2
        self.pipe = Pipeline(
            [lambda i=i: stage_module(i, width, layers) for i in range(S * virtual)],
            schedule=program,
            virtual_stages=virtual if virtual > 1 and isinstance(program, str) else None,
            chunks=M,
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: opt(p, lr=1e-4, momentum=0.9),
            checkpoint="never",
            transport="gloo",
            on_nonfinite=on_nonfinite or "raise",
            timeout=timeout,
        )
        held = {st.index for st in self.pipe.stages}  # (the V puts both ends on rank 0)
        self.first, self.last = 0 in held, S * virtual - 1 in held

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.pipe.step(x if self.first else None, y if self.last else None)
        self.pipe.flush()


def tp_stage(s: int, width: int, layers: int, tp_mesh: object = None) -> nn.Module:
    """MLP blocks (width -> 4 width -> width) of stage s; sharded when ``tp_mesh`` has > 1 rank."""
    torch.manual_seed(s)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)]
    m = nn.Sequential(*mods)
    if tp_mesh is not None and tp_mesh.size() > 1:  # type: ignore[attr-defined]
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {str(3 * k): ColwiseParallel() for k in range(layers)}
        plan.update({str(3 * k + 2): RowwiseParallel() for k in range(layers)})
        parallelize_module(m, tp_mesh, plan)  # type: ignore[arg-type]
    return m


class TPRunner:
    """``engine`` 1f1b on a pp x tp mesh (tp > 1) or on a pp x dp mesh whose replicas each
    run the whole batch (tp = 1): ``tp_cost`` above."""

    def __init__(self, tp: int, M: int, width: int, layers: int, timeout: float) -> None:
        import functools

        from torch.distributed.device_mesh import init_device_mesh

        from engine import Pipeline

        world = dist.get_world_size()
        other = "tp" if tp > 1 else "dp"
        S = world // 2
        mesh = init_device_mesh("cpu", (S, 2), mesh_dim_names=("pp", other))
        self.pipe = Pipeline(
            [functools.partial(tp_stage, i, width, layers) for i in range(S)],
            schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
            checkpoint="never", transport="gloo", mesh=mesh, timeout=timeout,
        )

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.pipe.step(x, y)
        self.pipe.flush()


class TorchRunner:
    """torch.distributed.pipelining with the same stage modules (keyword arguments: they moved
    between torch 2.11 and 2.13, see docs/ENVIRONMENT.md); ``virtual`` stages per rank (rank
    r holds stages r, r+S, ..., as the engine's interleaved schedule)."""

    def __init__(
        self, schedule: str, S: int, M: int, width: int, layers: int, virtual: int = 1,
        v_shape: bool = False,
    ) -> None:
        from torch.distributed import pipelining as tp

        s = dist.get_rank()
        held = [s, 2 * S - 1 - s] if v_shape else range(s, S * virtual, S)
        self.module = nn.ModuleList([stage_module(i, width, layers) for i in held])
        stages = [
            tp.PipelineStage(
                submodule=m, stage_index=i, num_stages=S * virtual, device=torch.device("cpu")
            )
            for i, m in zip(held, self.module, strict=True)
        ]
        cls = getattr(tp, schedule)
        # the multi-stage schedules take a list of this rank's stages (ZB-H1: one)
        arg = stages if issubclass(cls, tp.schedules.PipelineScheduleMulti) else stages[0]
        self.schedule = cls(arg, n_microbatches=M, loss_fn=nn.functional.mse_loss)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4, momentum=0.9)
        self.first, self.last = 0 in held, S * virtual - 1 in held

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in batches:
            self.opt.zero_grad(set_to_none=True)
            if self.first and self.last:  # the V: stage 0 and the last stage on rank 0
                self.schedule.step(x, target=y, losses=[])
            elif self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=[])
            else:
                self.schedule.step()
            self.opt.step()


Batches = list[tuple[torch.Tensor, torch.Tensor]]
Runner = EngineRunner | TorchRunner | TPRunner


def block(runner: Runner, batches: Batches) -> Callable[[], None]:
    """One timed call: ``len(batches)`` mini-batches (and the flush of an engine run)."""
    return lambda: runner.run(batches)


def cpu_lines(res: object, case: str, rank: int, steps: int) -> list[str]:
    """This rank's CPU time per mini-batch over the paired rounds (``--cpu``): its main thread
    (host work: Python, kernels, posting messages) and the rest of the process (gloo's loop
    thread moving the payloads), candidate vs peer, medians over rounds and the paired ratio.
    Where a candidate spends time its peer does not, on a machine whose ranks share cores."""
    main = res.by_probe("thread_cpu")  # type: ignore[attr-defined]
    proc = res.by_probe("process_cpu")  # type: ignore[attr-defined]
    rest = [p - m for p, m in zip(proc.candidate_s, main.candidate_s, strict=True)]
    rest_peer = [p - m for p, m in zip(proc.peer_s, main.peer_s, strict=True)]

    def ms(xs: list[float]) -> float:
        return float(sorted(xs)[len(xs) // 2]) * 1e3 / steps

    out = []
    for what, r, c, p in (("main thread", main, main.candidate_s, main.peer_s),
                          ("whole process", proc, proc.candidate_s, proc.peer_s)):
        st = r.stats
        out.append(f"cpu {case} rank {rank} {what}: {ms(c):.2f} vs {ms(p):.2f} ms/step, "
                   f"{st.median:.2f}x [{st.low:.2f}, {st.high:.2f}]")
    out.append(f"cpu {case} rank {rank} other threads: {ms(rest):.2f} vs {ms(rest_peer):.2f} ms/step")
    return out


def plot(rows: list[RatioRow], path: Path, title: str) -> None:
    """Time ratios with their 95 % intervals; theory markers for the async schedules."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, bench, heading in (
        (axes[0], "vs_torch", "engine / torch.distributed.pipelining (gloo)"),
        (axes[1], "async_vs_gpipe", "async schedules / engine gpipe"),
    ):
        sel = [r for r in rows if r.benchmark == bench]
        xs = list(range(len(sel)))
        med = [r.median_ratio for r in sel]
        err = [[r.median_ratio - r.ci_low for r in sel], [r.ci_high - r.median_ratio for r in sel]]
        ax.bar(xs, med, yerr=err, capsize=4, color="C0", label="measured (95% CI)")
        if bench == "async_vs_gpipe":
            theory = [r.extra["theory_ratio"] for r in sel]
            ax.scatter(xs, theory, color="C3", marker="_", s=400, label="M/(M+S-1)", zorder=3)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(xs, [r.case for r in sel])
        ax.set_ylabel("time ratio (below 1: candidate faster)")
        ax.set_title(heading)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chunks", type=int, default=8, help="M, micro-batches per mini-batch")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage")
    ap.add_argument("--steps", type=int, default=10, help="mini-batches per timed block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed blocks of each side first")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds per comparison")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--label", default="", help="machine label for the CSV/plot, e.g. 'CPU, 2 cores'"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--ranks", type=int, default=4, help="processes (= stages) when not started by torchrun"
    )
    ap.add_argument("--cases", nargs="*", default=None,
                    help="only these cases (gpipe 1f1b zbh1 interleaved interleaved-zb looped-bfs "
                    "zbv dualpipev pipedream 2bw pb); default all but looped-bfs, zbv, dualpipev")
    ap.add_argument("--cpu", action="store_true",
                    help="also print every rank's CPU time per step over the same rounds: its main "
                    "thread and its other (gloo) threads, candidate vs peer (cpu_lines)")
    ap.add_argument("--virtual", type=int, default=2,
                    help="v, stages per rank of the interleaved cases (S*v stage modules)")
    ap.add_argument("--peer-net-batch", action="store_true",
                    help="run torch's side with the default group's gloo network thread under "
                    "SCHED_BATCH too, as the engine runs its own groups' (engine/runtime/ranks/"
                    "transport/groups.py): the comparison without that advantage")
    args = ap.parse_args()
    under_torchrun(args.ranks, __file__)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    S, rank = dist.get_world_size(), dist.get_rank()
    if args.peer_net_batch:  # the default group's thread is the only one so far: torch's side
        from engine.runtime.ranks.transport.groups import batch_network_threads

        if batch_network_threads() == 0:
            ap.error("--peer-net-batch: no gloo network thread could be put under SCHED_BATCH")
    M, b = args.chunks, args.micro_batch
    batches = data(args.steps, M * b, args.width)

    def ours(schedule: str, virtual: int = 1) -> EngineRunner:
        return EngineRunner(schedule, S, M, args.width, args.layers, args.timeout, virtual)

    def theirs(schedule: str, virtual: int = 1, v_shape: bool = False) -> TorchRunner:
        return TorchRunner(schedule, S, M, args.width, args.layers, virtual, v_shape)

    v = args.virtual
    wanted = args.cases or ["gpipe", "1f1b", "zbh1", "interleaved", "interleaved-zb",
                            "pipedream", "2bw", "pb"]

    # (benchmark, case, candidate label, candidate, peer label, peer); built lazily so that
    # --cases builds only what it times
    makers: dict[str, Callable[[], tuple[str, str, str, Runner, str, Runner]]] = {
        "gpipe": lambda: ("vs_torch", "gpipe", "engine gpipe", ours("gpipe"),
                          "torch ScheduleGPipe", theirs("ScheduleGPipe")),
        "1f1b": lambda: ("vs_torch", "1f1b", "engine 1f1b", ours("1f1b"),
                         "torch Schedule1F1B", theirs("Schedule1F1B")),
        "zbh1": lambda: ("vs_torch", "zbh1", "engine zbh1", ours("zbh1"),
                         "torch ScheduleInterleavedZeroBubble, 1 stage/rank",
                         theirs("ScheduleInterleavedZeroBubble")),
        # the same S*v stage modules, v per rank, on both sides
        "interleaved": lambda: ("vs_torch", "interleaved", f"engine interleaved v={v}",
                                ours("interleaved", v), f"torch ScheduleInterleaved1F1B v={v}",
                                theirs("ScheduleInterleaved1F1B", v)),
        "interleaved-zb": lambda: ("vs_torch", "interleaved-zb", f"engine interleaved v={v}",
                                   ours("interleaved", v),
                                   f"torch ScheduleInterleavedZeroBubble v={v}",
                                   theirs("ScheduleInterleavedZeroBubble", v)),
        "looped-bfs": lambda: ("vs_torch", "looped-bfs", f"engine looped_bfs v={v}",
                               ours("looped_bfs", v), f"torch ScheduleLoopedBFS v={v}",
                               theirs("ScheduleLoopedBFS", v)),
        # 2S stage modules placed as a V on both sides
        "zbv": lambda: ("vs_torch", "zbv", "engine zbv", ours("zbv"),
                        "torch ScheduleZBVZeroBubble", theirs("ScheduleZBVZeroBubble", 2, True)),
        "dualpipev": lambda: ("vs_torch", "dualpipev", "engine dualpipev", ours("dualpipev"),
                              "torch ScheduleDualPipeV", theirs("ScheduleDualPipeV", 2, True)),
    }
    gpipe_peer: list[EngineRunner] = []

    def against_gpipe(s: str) -> tuple[str, str, str, Runner, str, Runner]:
        if not gpipe_peer:
            gpipe_peer.append(ours("gpipe"))
        return ("async_vs_gpipe", s, f"engine {s}", ours(s), "engine gpipe", gpipe_peer[0])

    for s in ("pipedream", "2bw", "pb"):
        makers[s] = lambda s=s: against_gpipe(s)
    # what the non-finite flags cost: one more message per gradient (not in the default list)
    makers["pb-skip-update"] = lambda: (
        "flags_cost", "pb-skip-update", "engine pb on_nonfinite=skip_update",
        EngineRunner("pb", S, M, args.width, args.layers, args.timeout, 1, "skip_update"),
        "engine pb on_nonfinite=raise",
        EngineRunner("pb", S, M, args.width, args.layers, args.timeout, 1, "raise"))
    makers["tp"] = lambda: (  # tensor parallelism's cost (4 ranks)
        "tp_cost", "tp", "engine 1f1b TP=2 x PP=2",
        TPRunner(2, M, args.width, args.layers, args.timeout),
        "engine 1f1b TP=1 x PP=2 (x2 replicas, whole batch each)",
        TPRunner(1, M, args.width, args.layers, args.timeout))
    if "tp" in wanted and S != 4:
        ap.error(f"--cases tp runs on 4 ranks (TP=2 x PP=2), not {S}")
    unknown = [c for c in wanted if c not in makers]
    if unknown:
        ap.error(f"unknown --cases {unknown}; choose from {sorted(makers)}")
    pairs = [makers[c]() for c in wanted]
    cores = os.cpu_count() or 0
    note = (
        f"{S} ranks on {cores} cores: ranks time-share cores, speed-ups are capped near {cores}x"
        if cores < S
        else ""
    )
    rows: list[RatioRow] = []
    for bench, case, cand_label, cand, peer_label, peer in pairs:
        # every rank runs the same rounds in the same order (inner fixed: no per-rank
        # calibration), so the barriers inside each block line up across ranks
        res = paired(block(cand, batches), block(peer, batches), rounds=args.rounds,
                     warmup=args.warmup, inner=1, sync=dist.barrier, units_per_call=args.steps,
                     probes=[ThreadCPU(), ProcessCPU()] if args.cpu else ())
        if args.cpu:
            lines = cpu_lines(res, case, rank, args.steps)
            every: list[list[str]] = [[] for _ in range(S)]
            dist.all_gather_object(every, lines)
            if rank == 0:
                print("\n".join(line for mine in every for line in mine), flush=True)
        theory = M / (M + S - 1) if bench == "async_vs_gpipe" else 1.0
        if args.peer_net_batch and bench == "vs_torch":
            peer_label += " (gloo thread SCHED_BATCH)"
        row = res.row(bench, case, cand_label, peer_label, label=args.label, note=note,
                      extra={"theory_ratio": theory, "chunks": M,
                             "stages": S // 2 if case == "tp" else S,
                             "virtual": v if case.startswith(("interleaved", "looped"))
                             else 2 if case in ("zbv", "dualpipev") else 1,
                             "micro_batch": b, "width": args.width, "steps": args.steps,
                             **({"tp": 2, "pp": 2} if case == "tp" else {})})
        rows.append(row)
        if rank == 0:
            print(summary_line(row), f"[{row.candidate_ms:.1f} vs {row.peer_ms:.1f} ms/step]"
                  + (f" theory {theory:.3f}" if bench == "async_vs_gpipe" else ""), flush=True)
    if rank == 0:
        csv_path = args.out / "pipeline_gloo.csv"
        write_ratio_csv(rows, csv_path)
        title = (f"S={S}, M={M}, micro-batch {b}, width {args.width}, {args.rounds} paired rounds"
                 f" -- {args.label or device_name(torch.device('cpu'))}")
        plot(rows, args.out / "pipeline_gloo.png", title)
        print(f"wrote {csv_path} and {args.out / 'pipeline_gloo.png'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
