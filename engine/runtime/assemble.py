"""Assembling a pipeline from its stage modules: :func:`build_local` and the steps it shares
with :func:`~engine.runtime.ranks.rank_build.build_rank`.

Why a module: once the modules and their weight stores exist (:mod:`~engine.runtime.setup.stores`),
both transports do the same things -- resolve the weight mitigations against the stage
optimizers, derive each stage's delay D_s by simulating the schedule and write it into the
optimizer's param groups, make one :class:`~engine.runtime.stage.stage.Stage` per module with its
weight policy -- and differ only in which stages a process holds, which executor runs them
and how they talk. The shared steps live here once; each builder returns a
:class:`~engine.runtime.parts.PipelineParts` that the facade holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from engine.errors import PipelineConfigError, ScheduleError
from engine.runtime.setup.stores import build_module, build_store, resolve_stage_specs
from engine.runtime.capture.synchronous import program_capture, refuse_program
from engine.runtime.setup.config import resolve_mitigations
from engine.runtime.stage.device_flags import check_skip_update
from engine.runtime.exec.executor import Executor
from engine.runtime.capture.optimizer_graphs import attach_step_graphs
from engine.runtime.setup.host_memory import keep_freed_host_memory
from engine.runtime.setup.l2 import L2State, apply_l2
from engine.runtime.parts import BuildRequest, PipelineParts
from engine.runtime.stage.policy import SpecTrain, make_policy
from engine.runtime.stage.stage import Stage
from engine.runtime.setup.step_features import attach as attach_features
from engine.runtime.exec.streams import StageStreams, default_stage_streams
from engine.runtime.ties.groups import TiedGradients, tie_stages, with_declared
from engine.schedule.analysis import analyze, schedule_delays
from engine.schedule.spec import ScheduleSpec, resolve_schedule

__all__ = [
    "StageSet", "build_local", "resolve_spec", "stage_modules", "make_stages", "make_streams",
    "attach_ties",
]


class StageSet(NamedTuple):
    """The stages a process holds, with what was resolved on the way."""

    stages: list[Stage]
    delays: list[int]  #: D_s of every stage of the schedule
    weight_prediction: str | None
    discrepancy_correction: bool
    device_flags: bool  #: on_nonfinite="skip_update" with flags on the device


def resolve_spec(req: BuildRequest, S: int) -> ScheduleSpec:
    """The schedule of ``req`` for ``S`` stages, resolved once (a family or a program)."""
    try:
        return resolve_schedule(
            req.schedule, stages=S, chunks=req.chunks, update_size=req.update_size,
            order=req.order, virtual_stages=req.virtual_stages,
        )
    except ScheduleError:
        raise  # a broken program: the error names the stage, the action and the rule
    except (ValueError, TypeError) as exc:
        raise PipelineConfigError(str(exc)) from None


def stage_modules(req: BuildRequest, spec: ScheduleSpec, specs: list[Any], held: list[int]) -> list[nn.Module]:
    """The modules of the ``held`` stages (a factory is called here, for its stage only),
    with deferred BatchNorm when asked; a stage's declared names are checked here."""
    from engine.model_names import NamesError, carry_naming, module_names

    modules = [build_module(specs[s], s) for s in held]
    if req.deferred_batch_norm:
        from engine.runtime.setup.batch_norm import convert_deferred_batch_norm

        modules = [carry_naming(m, convert_deferred_batch_norm(m, spec.chunks)) for m in modules]
    for s, m in zip(held, modules, strict=True):
        try:  # a declared naming must cover every tensor (engine.model_names)
            module_names(m)
        except NamesError as exc:
            raise PipelineConfigError(f"stage {s}: {exc}") from None
    return modules


def make_stages(
    req: BuildRequest, spec: ScheduleSpec, modules: list[nn.Module], built: list[Any],
    indices: list[int],
) -> StageSet:
    """Policies, delays and one Stage per held module, once modules and stores exist."""
    cfg = req.config
    bridges = [b for _, b in built]
    prediction, correction = resolve_mitigations(
        spec, bridges, req.weight_prediction, req.discrepancy_correction
    )
    device_flags = cfg.on_nonfinite == "skip_update" and check_skip_update(spec, bridges)
    if spec.program is not None:
        delays = list(analyze(spec.program).delays)
    else:
        delays = list(
            schedule_delays(spec.name, spec.stages, spec.chunks, spec.update_size, spec.order)
        )
    stages: list[Stage] = []
    for (store, bridge), module, s in zip(built, modules, indices, strict=True):
        policy = make_policy(
            spec.weights, spec.synchronous, spec.chunks, spec.stages, s, prediction, correction
        )
        if bridge is not None:
            bridge.set_delay(delays[s])
            try:
                bridge.serve(prediction is not None, correction, cfg.correction_decay)
            except ValueError as exc:
                raise PipelineConfigError(f"stage {s}: {exc}") from None
            if isinstance(policy, SpecTrain) and bridge.is_engine:
                bridge.set_group_option("prediction_horizon", float(policy.s_f))
            if device_flags:
                bridge.enable_skip_flags()
        st = Stage(
            s, spec.stages, module, store, bridge, policy, cfg.recompute(s, spec.stages),
            req.loss_fn if s == spec.stages - 1 else None, trace=cfg.trace,
        )
        if req.lr_scheduler is not None and bridge is not None:
            st.scheduler = req.lr_scheduler(bridge.opt)
        stages.append(st)
    devices = _devices(stages)
    if any(d.type == "cpu" for d in devices) or not devices:
        keep_freed_host_memory()
    return StageSet(stages, delays, prediction, correction, device_flags)


def _devices(stages: list[Stage]) -> set[torch.device]:
    return {p.device for st in stages for p in st.store.params}


def make_streams(stages: list[Stage], want: bool | None, l2: bool = False,
                 captured_async: bool = False) -> StageStreams:
    """One CUDA stream per stage when every stage lives on one CUDA device (``want``: the
    ``cuda_streams`` option; None: :func:`default_stage_streams` with ``l2`` and
    ``captured_async``, an asynchronous schedule with ``cuda_graphs="program"``)."""
    devices = _devices(stages)
    on_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    if l2 and not on_cuda and any(d.type == "cuda" for d in devices):
        raise PipelineConfigError(
            "l2_persistence sets each stage's window on its stage stream, and stage streams "
            f"need every stage on one CUDA device, found {sorted(map(str, devices))}; put "
            "the stages on one GPU or drop l2_persistence"
        )
    if want is None:
        want = default_stage_streams(on_cuda, l2, captured_async)
    if want and not on_cuda:
        raise PipelineConfigError(
            "cuda_streams=True needs every stage's parameters on one CUDA device, found "
            f"{sorted(map(str, devices))}; move the stages with .cuda() or pass cuda_streams=False"
        )
    device = next(iter(devices)) if (want and devices) else None
    return StageStreams([st.index for st in stages], device)


def equip(stages: list[Stage], streams: StageStreams, req: BuildRequest) -> L2State:
    """Optimizer-step graphs and L2 windows, on the stages' streams. The set-aside is given
    back when ``streams`` (held by the pipeline's parts and executor) is collected."""
    cfg = req.config
    if cfg.cuda_graphs == "optimizer":
        attach_step_graphs(stages)
    return apply_l2(stages, streams, cfg.l2_persistence, owner=streams)


def attach_ties(executor: Executor, ties: list[Any], stages: list[Stage]) -> None:
    """The executor sums the holders' gradients of each tie before a synchronous update."""
    executor.ties = TiedGradients(ties, stages) if ties else None


def build_local(req: BuildRequest) -> PipelineParts:
    """Every stage in this process (``transport="local"``): the exact simulator of each
    schedule's staleness."""
    cfg = req.config
    balance = req.balance
    if isinstance(balance, str):
        from engine.runtime.setup.balance import auto_balance

        balance = auto_balance(
            req.stages, balance, req.schedule, req.chunks, req.order, req.num_stages,
            req.sample, req.memory_cap_bytes, repeats=req.balance_repeats,
            profile=req.balance_profile,
        )
    specs = resolve_stage_specs(req.stages, balance)
    spec = resolve_spec(req, len(specs))
    refuse_program(spec, cfg, req.features)
    indices = list(range(spec.stages))
    modules = stage_modules(req, spec, specs, indices)
    found = tie_stages(modules, spec)
    ties = with_declared(found, req.ties, spec, dict(enumerate(modules)))[0]
    built = [build_store(m, s, req.optimizer, cfg.cuda_graphs) for s, m in enumerate(modules)]
    made = make_stages(req, spec, modules, built, indices)
    stages = made.stages
    devices = _devices(stages)
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    streams = make_streams(stages, cfg.cuda_streams, l2=bool(cfg.l2_persistence),
                           captured_async=cfg.cuda_graphs == "program" and not spec.synchronous)
    l2 = equip(stages, streams, req)
    executor = Executor(
        spec, stages, on_nonfinite=cfg.on_nonfinite, streams=streams,
        device_flags=made.device_flags,
    )
    capture = program_capture(executor) if cfg.cuda_graphs == "program" else None
    attach_ties(executor, ties, stages)
    attach_features(req.features, executor, stages, spec, device, ties)
    return PipelineParts(
        spec=spec, config=cfg, features=req.features, stages=stages, executor=executor,
        streams=streams, l2=l2, delays=made.delays, weight_prediction=made.weight_prediction,
        discrepancy_correction=made.discrepancy_correction, device=device,
        balance=list(balance) if balance is not None else None, ties=ties, capture=capture,
    )
