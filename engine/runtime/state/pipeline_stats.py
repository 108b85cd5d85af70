"""``Pipeline.stats()``: the facts a run reports, gathered in one place.

Why a module: the keys come from every part of the runtime (the executor's counters and
clock, the stores, the L2 and CUDA-graph options, clipping, mixed precision, offload,
throughput); collecting them here keeps the facade small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts
    from engine.runtime.state.throughput import StepMeter

__all__ = ["pipeline_stats"]


def pipeline_stats(parts: PipelineParts, meter: StepMeter) -> dict[str, Any]:
    """Per-stage facts measured by the engine's own clock and counters.

    ``delays``: D_s set on the optimizers (derived by simulating the schedule);
    ``measured_delays``: {delay: micro-batches} per stage, counted when their gradient was
    applied; ``weight_versions``: peak distinct weight versions kept per stage (live
    included); ``weight_buffers``: peak weight buffers held (live, kept versions, the
    transient); ``weight_bytes``: bytes of live weights, gradients, slots and the pool;
    ``activation_peak``: peak micro-batches stashed per stage; ``bubble_fraction``: idle
    share of stage time with unit costs (F = 1, B = 2); ``bubble_fraction_wall``: the
    same with measured action times; ``compiled_programs``: step programs compiled so
    far (it stops growing once the schedule's steps repeat); ``l2_persisting_bytes``:
    persisting-L2 bytes granted per stage (0 when off or unsupported), and
    ``l2_persistence``: the ``requested`` fraction, the device's ``set_aside_bytes`` and
    ``max_persisting_bytes``, and the ``reason`` when a stage got nothing;
    ``cuda_graphs``: per stage (None when off) optimizer steps ``replays``-ed from a graph,
    ``captures``, ``eager`` steps and the ``last_eager_reason``; ``capture``: the ``mode``
    (``"off"``, ``"optimizer"``, ``"program"``) and, for ``"program"``, the ``window``, steps
    ``captures``-d, ``replays``, ``eager`` steps, ``evictions``, ``graphs`` kept and the
    ``last_eager_reason`` (engine/runtime/capture/synchronous.py); ``grad_norm``: per stage
    the last gradient norm clipping measured (a device tensor, not read here; the global
    norm, the same tensor at every stage, for synchronous schedules; None without
    ``clip_grad_norm`` or before the first update); ``loss_scale``: the float16 loss
    scale (a device tensor; None without ``autocast=torch.float16``; asynchronous
    schedules: a list, per stage its own scale) and
    ``amp_skipped_steps``: synchronous steps whose update found_inf skipped,
    ``amp_skipped_updates``: asynchronous, per stage, update groups found_inf skipped; ``activation_bytes``:
    per stage with ``offload_activations`` (else None) the peak (``host_peak``) and current
    (``host_now``) bytes of saved activations held in host memory: the device bytes offload
    saves (without it they stay on the device); ``throughput``: ``step_time_s``,
    ``last_step_time_s``, ``samples_per_s``, ``tokens_per_s``, ``bubble_modelled`` and
    ``bubble_measured`` (engine/runtime/state/throughput.py says how each is measured).
    The facade adds ``schedule_choice``: with ``schedule="auto"`` the family, placement,
    simulated step time, predicted peak per rank and the one-line ``reason`` the chooser
    gave, with every candidate it tried (engine/schedule/auto.py); None otherwise.
    """
    ex = parts.executor
    ex.fold_flags()  # "skip_update" counts on the device: one host read
    if parts.capture is not None:
        parts.capture.fold()
    unit, wall = ex.clock.bubble()
    clipper = ex.clipper
    return {
        "schedule": parts.spec.name,
        "stages": parts.spec.stages,
        "chunks": parts.spec.chunks,
        "update_size": parts.spec.update_size,
        "steps": ex.steps,
        "skipped_steps": ex.skipped_steps,
        "dropped_microbatches": ex.dropped,
        "updates": [st.updates for st in parts.stages],
        "skipped_updates": [st.skipped_updates for st in parts.stages],
        "delays": list(parts.delays),
        "measured_delays": [dict(sorted(st.delay_counts.items())) for st in parts.stages],
        "weight_versions": [st.store.peak_versions for st in parts.stages],
        "weight_buffers": [st.store.peak_buffers for st in parts.stages],
        "weight_bytes": [st.store.bytes() for st in parts.stages],
        "activation_peak": [st.stash.peak for st in parts.stages],
        "bubble_fraction": unit,
        "bubble_fraction_wall": wall,
        "compiled_programs": ex.compiler.compiled,
        "transport": parts.config.transport,
        "stage_indices": [st.index for st in parts.stages],
        "l2_persisting_bytes": list(parts.l2.granted),
        "l2_persistence": parts.l2.stats(),
        "capture": (parts.capture.stats() if parts.capture is not None
                    else {"mode": parts.config.cuda_graphs or "off"}),
        "cuda_graphs": [
            st.bridge.graphs.stats()
            if st.bridge is not None and st.bridge.graphs is not None else None
            for st in parts.stages
        ],
        "grad_norm": clipper.stats() if clipper is not None else [None] * len(parts.stages),
        **_amp_stats(parts, ex.loss_scaler),
        "throughput": meter.stats(
            sum(st.busy_ns for st in parts.stages) / 1e9, unit, wall, parts.config.distributed
        ),
        "activation_bytes": [
            st.offload.stats() if st.offload is not None else None
            for st in parts.stages
        ],
    }


def _amp_stats(parts: PipelineParts, scaler: Any) -> dict[str, Any]:
    """float16 loss scaling: the current scale (a device tensor) and the steps found_inf
    skipped so far (one host read)."""
    if scaler is None:
        return {"loss_scale": None, "amp_skipped_steps": 0, "amp_skipped_updates": None}
    if not scaler.synchronous:  # per stage: update groups whose found_inf was set
        skips = [scaler.group_skips.get(st.index) for st in parts.stages]
        return {"loss_scale": [scaler.stage_scale.get(st.index) for st in parts.stages],
                "amp_skipped_steps": 0,
                "amp_skipped_updates": [0 if t is None else int(t.item()) for t in skips]}
    return {"loss_scale": scaler.scale, "amp_skipped_steps": int(scaler.skipped.item()),
            "amp_skipped_updates": None}
