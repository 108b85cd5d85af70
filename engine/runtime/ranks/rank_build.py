"""Building one rank's share of a pipeline (gloo/NCCL): :func:`build_rank`.

Why a module of its own: under ``torchrun`` a process builds only the stages it holds (from
factories, so no process materialises the whole model), checks with every other rank that
they were all built alike (:mod:`~engine.runtime.ranks.agreement`), connects its point-to-point
transport and its data-parallel gradient reduction, and gets a
:class:`~engine.runtime.ranks.rank.RankExecutor` to run its lane of each step program. What it
shares with a local build (policies, delays, stages) is :mod:`~engine.runtime.assemble`'s;
it returns the same :class:`~engine.runtime.parts.PipelineParts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from engine.errors import PipelineConfigError
from engine.runtime.assemble import (
    attach_ties, equip, make_stages, resolve_spec, stage_modules,
)
from engine.runtime.setup.stores import build_store, resolve_stage_specs
from engine.runtime.parts import BuildRequest, PipelineParts
from engine.runtime.exec.placement import RankPlacement
from engine.runtime.ranks.rank import RankExecutor
from engine.runtime.setup.step_features import attach as attach_features
from engine.runtime.exec.streams import StageStreams
from engine.runtime.stage.device_flags import SkipFlags

__all__ = ["build_rank"]


def build_rank(req: BuildRequest) -> PipelineParts:
    """This rank's stages, transport, gradient reduction and executor (module docstring)."""
    from engine.runtime.ranks.distributed import RankRuntime, broadcast_balance
    from engine.runtime.ranks.transport.groups import GroupCalls
    from engine.runtime.ranks.transport.layout import init_distributed, make_layout, transport_device
    from engine.runtime.ranks.transport import make_transport

    cfg = req.config
    try:
        init_distributed(cfg.transport, cfg.timeout)
    except ValueError as exc:
        raise PipelineConfigError(str(exc)) from None
    balance = req.balance
    if isinstance(balance, str):
        from engine.runtime.setup.balance import auto_balance

        args = (req.stages, balance, req.schedule, req.chunks, req.order, req.num_stages,
                req.sample, req.memory_cap_bytes)
        extra = dict(repeats=req.balance_repeats, profile=req.balance_profile)
        try:
            balance = broadcast_balance(lambda: auto_balance(*args, **extra), cfg.timeout)
        except ValueError as exc:
            raise PipelineConfigError(str(exc)) from exc
    specs = resolve_stage_specs(req.stages, balance)
    spec = resolve_spec(req, len(specs))
    if cfg.transport == "nccl" and cfg.cuda_graphs == "optimizer" and not spec.synchronous:
        raise PipelineConfigError(
            f"cuda_graphs='optimizer' with the asynchronous {spec.describe()} and "
            "transport='nccl': capturing an optimizer step synchronises the device in the "
            "middle of a step, while sends whose receives the neighbours post later are still "
            "pending (a hang). Use a synchronous schedule, cuda_graphs=False, or "
            "transport='local'"
        )
    virtual = spec.program is not None and spec.program.rank_order is not None
    ranks = spec.stages
    if virtual:  # v stages per rank (engine/runtime/ranks/virtual.py)
        from engine.runtime.ranks.virtual import check_virtual

        ranks = check_virtual(spec, cfg.data_parallel)
    try:
        if req.mesh is not None:  # tensor parallelism (runtime/ranks/mesh.py)
            from engine.runtime.ranks.mesh import mesh_layout, refuse_with_mesh

            refuse_with_mesh(virtual, req.ties, req.stages)
            layout = mesh_layout(req.mesh, ranks, cfg.timeout)
        else:
            layout = make_layout(ranks, cfg.data_parallel, cfg.transport, cfg.timeout)
    except ValueError as exc:
        per = f" (interleaved: the {spec.stages} virtual stages run on {ranks} ranks)" if virtual else ""
        raise PipelineConfigError(f"{exc}{per}") from None
    place = RankPlacement.of(spec)  # round-robin, the V, or any map (engine/runtime/exec/placement.py)
    layout = dataclasses.replace(layout, last_index=place.last)
    mine = place.held(layout.stage)
    from engine.runtime.ranks.mesh import with_tp_mesh  # (a tp_mesh= factory gets its sub-mesh)
    from engine.runtime.tensor_parallel import finish_stages, localize_stages

    modules = stage_modules(req, spec, [with_tp_mesh(f, layout) for f in specs], mine)
    tp_stages = localize_stages(modules, mine, layout, spec.stages)  # DTensor weights -> shards
    device = transport_device(cfg.transport)  # (NCCL: this rank's GPU; the CPU under the twin)
    for s, module in zip(mine, modules, strict=True):
        if cfg.transport == "nccl":
            module.to(device)
        elif any(p.is_cuda for p in module.parameters()):
            raise PipelineConfigError(
                f"stage {s} has CUDA parameters but transport='gloo' carries CPU tensors; "
                "use transport='nccl' (one GPU per rank) or keep the model on CPU"
            )
    from engine.runtime.ties.groups import broadcast_owner, connect_ties, tie_stages, with_declared

    ties: list[Any] = []
    if all(isinstance(m, nn.Module) for m in specs):  # factories: only declared ties
        ties = tie_stages(list(specs), spec, stages=mine)
    here = dict(zip(mine, modules, strict=True))
    ties, declared, tie_shapes = with_declared(ties, req.ties, spec, here)
    connect_ties(ties, ranks, cfg.data_parallel, layout.stage, layout.replica, place.rank_of,
                 cfg.timeout)
    built = [build_store(m, s, req.optimizer, cfg.cuda_graphs) for s, m in zip(mine, modules, strict=True)]
    from engine.runtime.ranks.agreement import agree, fingerprint

    bridge = built[0][1]
    options = dict(
        weight_prediction=req.weight_prediction,
        discrepancy_correction=req.discrepancy_correction,
        deferred_batch_norm=req.deferred_batch_norm,
        activation_shapes=cfg.activation_shapes,
        **req.features.describe(),
        **tie_shapes,  # compared among the ranks holding each declared tie
        **({"tensor_parallel": layout.tp} if req.mesh is not None else {}),
    )
    held = modules[0] if not virtual else nn.ModuleList(modules)
    fp = fingerprint(spec, cfg, options, ties, bridge.opt if bridge is not None else None, held)
    agree(fp, layout.rank, ranks, device, stage_of=getattr(layout, "place_of", None),
          timeout=cfg.timeout)
    broadcast_owner(declared, here, lambda s: layout.replica * ranks + place.rank_of(s))
    rank: Any
    if virtual:
        from engine.runtime.ranks.virtual import VirtualRankRuntime, virtual_transports

        tps = virtual_transports(cfg.transport, layout, spec.stages, device, cfg.timeout, place)
        rank = VirtualRankRuntime(layout, tps, cfg.timeout, first_index=place.first, chunks=spec.chunks)
    else:
        nccl = cfg.transport == "nccl"
        tp = make_transport(
            cfg.transport, mine[0], list(layout.pipeline_ranks),
            layout.channel_groups if nccl else layout.pipeline_group, device, cfg.timeout,
            control=GroupCalls(layout.control_group) if nccl else None,
        )
        if not nccl:
            tp.use_shared_memory()  # collective: neighbours on this host talk through rings
        rank = RankRuntime(layout, tp, cfg.timeout, first_index=place.first, chunks=spec.chunks)
        tps = {mine[0]: tp}
    if rank.notices is not None:  # NCCL: which activations carry a header
        for t in tps.values():
            for side in getattr(t, "sides", [t]):
                side.notices = rank.notices
                side.every_header = cfg.activation_shapes == "any"
    from engine.runtime.ranks.transport.teardown import track

    track(rank)  # its pending communication is settled at exit, before finalization
    made = make_stages(req, spec, modules, built, mine)
    stages = made.stages
    streams = StageStreams(mine, None)
    l2 = equip(stages, streams, req)
    for st in stages:  # (a virtual stage's runtime names it in errors)
        reduce = (rank.per_stage[st.index] if virtual else rank).reduce_gradients
        skip = st.bridge.skip if st.bridge is not None else None
        if skip is not None:  # one replica's flag skips the update on every replica
            reduce = _with_flag(reduce, skip)
        st.grad_hook = reduce
    if made.device_flags:
        for t in tps.values():
            t.flags = True  # gradients carry their micro-batch's non-finite flag
    if virtual:
        rank.stages = [(st.index, st.module, st.loss_fn) for st in stages]
    executor = RankExecutor(
        spec, stages, on_nonfinite=cfg.on_nonfinite, streams=streams, rank=rank,
        transports=tps, lane=layout.stage if virtual else mine[0], device_flags=made.device_flags,
    )
    executor.rng_device = device  # (a rolled-back step restores this GPU's RNG: NCCL)
    attach_ties(executor, ties, stages)
    attach_features(req.features, executor, stages, spec, device, ties, layout.pipeline_group)
    finish_stages(stages, tp_stages, layout, req.features, executor, rank)  # tensor parallelism
    return PipelineParts(
        spec=spec, config=cfg, features=req.features, stages=stages, executor=executor,
        streams=streams, l2=l2, delays=made.delays, weight_prediction=made.weight_prediction,
        discrepancy_correction=made.discrepancy_correction, device=device,
        balance=list(balance) if balance is not None else None, ties=ties, layout=layout,
        replicas=cfg.data_parallel, rank=rank,
    )


def _with_flag(reduce: Callable[[list[Tensor]], None], skip: SkipFlags) -> Callable[[list[Tensor]], None]:
    """The data-parallel gradient mean, with the stage's found_inf accumulator averaged along
    (non-zero on every replica when it is on any: they skip the same updates)."""
    def hook(flats: list[Tensor]) -> None:
        reduce([*flats, skip.found_inf])
        skip.averaged()  # no longer a 0/1 flag: the skip count compares it with 0

    return hook
