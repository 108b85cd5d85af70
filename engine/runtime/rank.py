"""One stage per process (gloo/NCCL): building a rank's stage and running its step programs.

Why a module of its own: under ``torchrun`` a process builds only its own stage (from a
factory, so no process materialises the whole model), runs only its stage's list of each
compiled step program -- sends and receives through the blocking point-to-point transport --
and meets the other ranks for three things (:mod:`engine.runtime.distributed`): the shape
handshake at the first step, the step's loss (sent by the last stage to every rank of its
replica), and the data-parallel all-reduce of the flat gradient buffers.

A synchronous step runs the stage's forwards, backwards and communication, then the loss
check (on every rank, from the shared loss message), then its update; an asynchronous step
runs the whole list. The weights after any number of steps equal the local run's bit for bit
on CPU: every rank executes exactly its stage's actions of the same compiled programs.
With virtual stages (interleaved 1F1B) a rank builds and runs its v stages, their actions
merged in the schedule's rank order (:mod:`engine.runtime.virtual`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineConfigError
from engine.runtime.build import build_module, build_store, resolve_stage_specs
from engine.runtime.lane import RankLane
from engine.runtime.placement import RankPlacement
from engine.runtime.protocol import StepProtocol
from engine.runtime.streams import StageStreams

if TYPE_CHECKING:
    from engine.runtime.pipeline import Pipeline

__all__ = ["build_distributed", "RankExecutor"]


def build_distributed(
    pipe: Pipeline,
    stages: Any,
    schedule: Any,
    chunks: int | None,
    loss_fn: Callable[[Tensor, Any], Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    update_size: int | None,
    order: str | None,
    balance: Any,
    weight_prediction: str | None,
    discrepancy_correction: bool | None,
    lr_scheduler: Any,
    num_stages: int | None,
    sample: Tensor | None,
    memory_cap_bytes: float | None,
    deferred_batch_norm: bool = False,
    balance_repeats: int = 3,
    balance_profile: Any = None,
    tied: Any = None,
) -> None:
    """The distributed half of ``Pipeline.__init__`` (``tied``: its ``ties`` argument)."""
    from engine.runtime.distributed import RankRuntime, broadcast_balance
    from engine.runtime.transport.layout import init_distributed, make_layout
    from engine.runtime.transport.p2p import P2PTransport

    cfg = pipe.config
    try:
        init_distributed(cfg.transport, cfg.timeout)
    except ValueError as exc:
        raise PipelineConfigError(str(exc)) from None
    if isinstance(balance, str):
        from engine.runtime.balance import auto_balance

        args = (stages, balance, schedule, chunks, order, num_stages, sample, memory_cap_bytes)
        extra = dict(repeats=balance_repeats, profile=balance_profile)
        try:
            balance = broadcast_balance(lambda: auto_balance(*args, **extra), cfg.timeout)
        except ValueError as exc:
            raise PipelineConfigError(str(exc)) from exc
    specs = resolve_stage_specs(stages, balance)
    pipe.balance = list(balance) if balance is not None else None
    spec = pipe._resolve(schedule, len(specs), chunks, update_size, order)
    virtual = spec.program is not None and spec.program.rank_order is not None
    ranks = spec.stages
    if virtual:  # v stages per rank (engine/runtime/virtual.py)
        from engine.runtime.virtual import check_virtual

        ranks = check_virtual(spec, cfg.data_parallel)
    try:
        layout = make_layout(ranks, cfg.data_parallel)
    except ValueError as exc:
        per = f" (interleaved: the {spec.stages} virtual stages run on {ranks} ranks)" if virtual else ""
        raise PipelineConfigError(f"{exc}{per}") from None
    place = RankPlacement.of(spec)  # round-robin, the V, or any map (engine/runtime/placement.py)
    layout = dataclasses.replace(layout, last_index=place.last)
    mine = place.held(layout.stage)
    modules = [build_module(specs[s], s) for s in mine]
    if deferred_batch_norm:
        from engine.runtime.batch_norm import convert_deferred_batch_norm

        modules = [convert_deferred_batch_norm(m, spec.chunks) for m in modules]
    device = torch.device("cpu")
    for s, module in zip(mine, modules, strict=True):
        if cfg.transport == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            module.to(device)
        elif any(p.is_cuda for p in module.parameters()):
            raise PipelineConfigError(
                f"stage {s} has CUDA parameters but transport='gloo' carries CPU tensors; "
                "use transport='nccl' (one GPU per rank) or keep the model on CPU"
            )
    from engine.runtime.ties import broadcast_owner, connect_ties, tie_stages, with_declared

    ties: list[Any] = []
    if all(isinstance(m, nn.Module) for m in specs):  # factories: only declared ties
        ties = tie_stages(list(specs), spec, stages=mine)
    here = dict(zip(mine, modules, strict=True))
    ties, declared, tie_shapes = with_declared(ties, tied, spec, here)
    connect_ties(ties, ranks, cfg.data_parallel, layout.stage, layout.replica, place.rank_of)
    built = [
        build_store(m, s, optimizer, pipe.config.cuda_graphs)
        for s, m in zip(mine, modules, strict=True)
    ]
    from engine.runtime.agreement import agree, fingerprint

    bridge = built[0][1]
    options = dict(
        weight_prediction=weight_prediction,
        discrepancy_correction=discrepancy_correction,
        deferred_batch_norm=deferred_batch_norm,
        **pipe.features.describe(),
        **tie_shapes,  # compared among the ranks holding each declared tie
    )
    held = modules[0] if not virtual else nn.ModuleList(modules)
    fp = fingerprint(spec, cfg, options, ties, bridge.opt if bridge is not None else None, held)
    agree(fp, layout.rank, ranks, device)
    broadcast_owner(declared, here, lambda s: layout.replica * ranks + place.rank_of(s))
    pipe.device = device
    pipe.layout = layout
    if virtual:
        from engine.runtime.virtual import VirtualRankRuntime, virtual_transports

        tps = virtual_transports(cfg.transport, layout, spec.stages, device, cfg.timeout, place)
        pipe._rank = VirtualRankRuntime(layout, tps, cfg.timeout)
    else:
        tp = P2PTransport(
            cfg.transport, mine[0], list(layout.pipeline_ranks), layout.pipeline_group, device,
            cfg.timeout,
        )
        pipe._rank = RankRuntime(layout, tp, cfg.timeout)
        tps = {mine[0]: tp}
    from engine.runtime.transport.teardown import track

    track(pipe._rank)  # its pending communication is settled at exit, before finalization
    streams = StageStreams(mine, None)
    pipe._finish(
        spec, modules, built, mine, loss_fn, weight_prediction, discrepancy_correction,
        lr_scheduler, streams=streams,
    )
    device_flags = pipe._executor.flags is not None  # (the local executor, replaced below)
    for st in pipe.stages:  # (a virtual stage's runtime names it in errors)
        reduce = (pipe._rank.per_stage[st.index] if virtual else pipe._rank).reduce_gradients
        skip = st.bridge.skip if st.bridge is not None else None
        if skip is not None:  # one replica's flag skips the update on every replica
            reduce = _with_flag(reduce, skip.found_inf)
        st.grad_hook = reduce
    if device_flags:
        for tp in tps.values():
            tp.flags = True  # gradients carry their micro-batch's non-finite flag
    if virtual:
        pipe._rank.stages = [(st.index, st.module, st.loss_fn) for st in pipe.stages]
    pipe._executor = RankExecutor(
        spec, pipe.stages, on_nonfinite=cfg.on_nonfinite, streams=streams, rank=pipe._rank,
        transports=tps, lane=layout.stage if virtual else mine[0], device_flags=device_flags,
    )
    pipe.ties = ties
    if ties:
        from engine.runtime.ties import TiedGradients

        pipe._executor.ties = TiedGradients(ties, pipe.stages)
    pipe.replicas = cfg.data_parallel
    from engine.runtime.step_features import attach

    attach(pipe, layout.pipeline_group)  # clipping, mixed precision, offload


def _with_flag(reduce: Callable[[list[Tensor]], None], found_inf: Tensor) -> Callable[[list[Tensor]], None]:
    """The data-parallel gradient mean, with the stage's found_inf accumulator averaged along
    (non-zero on every replica when it is on any: they skip the same updates)."""
    return lambda flats: reduce([*flats, found_inf])


class RankExecutor(StepProtocol):
    """The step protocol on one rank: its stage's op list with blocking communication (with
    virtual stages: its stages' lists merged in the schedule's rank order, ``lane``)."""

    def __init__(
        self, *args: Any, rank: Any, transports: dict[int, Any], lane: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.immediate_nonfinite = False  # checked once per step, on every rank
        self.rank = rank
        self.transport = rank.transport
        self.transports = transports  # stage -> its transport
        self.runner: RankLane = RankLane(self, rank, transports, lane)
        lay = rank.layout
        # a user stage that raises mid-step is rolled back on every rank (synchronous) or its
        # micro-batch dropped (asynchronous), with abort/dropped frames (transport/abort.py):
        # gloo steps of one replica, one stage per rank
        frames = (
            getattr(rank.transport, "backend", None) == "gloo" and lay.replicas == 1
            and len(transports) == 1 and hasattr(rank.transport, "send_abort")
            and lay.last_rank != lay.pipeline_ranks[0]
        )
        rank.relay = self.runner.aborts = frames and self.sync
        # an asynchronous step drops the micro-batch of an action that raised, as locally
        self.runner.drops = frames and not self.sync

    def wire_state(self) -> dict[str, Any]:
        """The lane's messages at a step boundary, for the in-flight state (RankLane.wire_state)."""
        return self.runner.wire_state()

    def load_wire_state(self, state: dict[str, Any]) -> None:
        self.runner.load_wire_state(state)
