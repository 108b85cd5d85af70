"""Pipeline schedules as data: IR, generators, validator, analysis and pictures.

Why this package exists: every schedule of ALGORITHMS.md (the catalog's families, NAMES:
naive, gpipe, 1f1b, zbh1, interleaved, looped_bfs, zbv, vhalf, vmin, dualpipev, pipedream,
2bw, pb in dataflow or 1f1b order) is written once as action lists. The
runtime executes those lists (in one process or over gloo/NCCL), the validator proves them
deadlock-free and well formed before anything runs, and the analysis derives each stage's
delay D_s, weight versions and activation peak from them -- never from hand-typed formulas.

    >>> from engine.schedule import generate, format_schedule, analyze
    >>> s = generate("pb", stages=3, chunks=3)
    >>> analyze(s).delays
    (2, 2, 0)

(With only 3 micro-batches stage 0 never reaches its steady-state delay 2(S-1) = 4; use
``steps`` to cover more mini-batches.)

Modules: ``ir`` (Action, Schedule), ``catalog`` (one row per family: its generator,
placement and facts; the only module that reads a family name), ``orders`` (the per-stage
compute orders), ``streams`` (stage_actions: the open-ended per-stage streams every runtime
transport executes), ``text`` (format/parse), ``generators`` (generate: the streams cut at
T*M micro-batches, or a rank-program family's program),
``interleaved`` (interleaved 1F1B: v virtual stages per rank and each rank's order),
``ranked`` (programs stated rank by rank: placement, overlapped pairs), ``vshape_orders``
(ZB-V, DualPipeV, looped BFS), ``vblocks`` (V-Min, V-Half from their building blocks),
``vshape`` (those builders by their historical module), ``auto`` (schedule="auto": the
fastest family whose memory fits), ``tdp`` (torch.distributed.pipelining's CSV: from_csv, to_csv),
``simulate`` (global clock, deadlock detection), ``validate``, ``versions`` (t_F/t_B and
weight versions per policy), ``analysis`` (analyze), ``render`` (PNG, Chrome trace).
Importing this package does not import torch or matplotlib.
"""

from __future__ import annotations

from engine.schedule.catalog import NAMES, family
from engine.schedule.analysis import (
    MicroBatchRecord,
    ScheduleReport,
    analyze,
    schedule_delays,
    steady_steps,
)
from engine.schedule.errors import ScheduleError
from engine.schedule.generators import SCHEDULES, generate
from engine.schedule.interleaved import interleaved
from engine.schedule.ir import Action, Kind, Schedule
from engine.schedule.render import chrome_trace, render_timeline
from engine.schedule.simulate import Costs, Timeline, simulate
from engine.schedule.streams import stage_actions, stage_ticks, truncate
from engine.schedule.text import format_schedule, parse
from engine.schedule.validate import activation_bound, validate
from engine.schedule.versions import Versions, stage_versions
from engine.schedule.tdp import from_csv, to_csv
from engine.schedule.vshape import dualpipev, looped_bfs, vhalf, vmin, zbv

__all__ = [
    "NAMES",
    "SCHEDULES",
    "Action",
    "Costs",
    "Kind",
    "MicroBatchRecord",
    "Schedule",
    "ScheduleError",
    "ScheduleReport",
    "Timeline",
    "Versions",
    "activation_bound",
    "analyze",
    "chrome_trace",
    "dualpipev",
    "family",
    "format_schedule",
    "from_csv",
    "generate",
    "interleaved",
    "looped_bfs",
    "parse",
    "render_timeline",
    "schedule_delays",
    "simulate",
    "stage_actions",
    "stage_ticks",
    "stage_versions",
    "steady_steps",
    "to_csv",
    "truncate",
    "validate",
    "vhalf",
    "vmin",
    "zbv",
]
