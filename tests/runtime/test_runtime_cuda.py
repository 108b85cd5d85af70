"""The local transport on one GPU: every stage on its own CUDA stream, hand-offs ordered by
events. Semantics must be those of the CPU run (same weight versions read by every F and B,
same updates; values equal up to GPU arithmetic), and stages must actually overlap.

All tests here need a CUDA GPU (marked ``cuda``; skipped on CPU machines).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_runtime_support import probe_stages, reads
from torch import nn

from engine import Pipeline

pytestmark = pytest.mark.cuda

CONFIGS: dict[str, dict[str, Any]] = {
    "naive": dict(schedule="naive"),
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b", checkpoint="never"),
    "pipedream": dict(schedule="pipedream"),
    "2bw": dict(schedule="2bw"),
    "pb": dict(schedule="pb", checkpoint="never"),
    "pb-1f1b-k2": dict(schedule="pb", order="1f1b", update_size=2),
    "pb-lwp": dict(schedule="pb", weight_prediction="lwp"),
    "pb-spectrain": dict(schedule="pb", weight_prediction="spectrain"),
    "pb-t2": dict(schedule="pb", discrepancy_correction=True, checkpoint="never"),
}


def _opt(name: str):
    import engine.optim as eo

    pred = "linear" if "lwp" in name or "spectrain" in name else None
    corr = name.endswith("t2")
    return lambda p: eo.SGD(p, lr=0.05, momentum=0.9, prediction=pred, discrepancy_correction=corr)


def _run(name: str, device: str, S: int = 4, M: int = 4, steps: int = 6):
    stages, probes = probe_stages(S)
    for m in stages:
        m.to(device)
    kw = dict(CONFIGS[name])
    pipe = Pipeline(
        stages, chunks=M, loss_fn=nn.functional.mse_loss, optimizer=_opt(name), trace=True,
        cuda_streams=device == "cuda", **kw  # stage streams are off by default (streams.py)
    )
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2 * M, 3, generator=g), torch.randn(2 * M, 1, generator=g)
        losses.append(pipe.step(x.to(device), y.to(device)).cpu())
    pipe.flush()
    torch.cuda.synchronize() if device == "cuda" else None
    return pipe, probes, losses


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_streams_keep_the_cpu_semantics(name: str) -> None:
    gpu, gprobes, glosses = _run(name, "cuda")
    assert gpu.parts.executor.streams.cuda and len(gpu.parts.executor.streams.streams) == gpu.num_stages
    cpu, cprobes, closses = _run(name, "cpu")
    for s in range(cpu.num_stages):
        assert gpu.stages[s].records == cpu.stages[s].records, f"stage {s}: versions differ"
    assert gpu.stats()["measured_delays"] == cpu.stats()["measured_delays"]
    greads, creads = reads(gprobes), reads(cprobes)
    assert greads.keys() == creads.keys()
    for key in creads:
        for a, b in zip(greads[key], creads[key], strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
    for a, b in zip(glosses, closses, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for gs, cs in zip(gpu.stages, cpu.stages, strict=True):
        for a, b in zip(gs.module.parameters(), cs.module.parameters(), strict=True):
            torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)


def test_gpu_stages_overlap_in_time() -> None:
    """CUDA events around every F/B on each stage's stream: some stage-0 action must run
    while a stage-1 action runs (with one stream for both, they could not)."""
    torch.manual_seed(0)
    width = 2048
    stages = [nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).cuda() for _ in range(2)]
    pipe = Pipeline(
        stages,
        schedule="gpipe",
        chunks=8,
        loss_fn=lambda out, y: out.float().pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-6),
        checkpoint="never",
        cuda_streams=True,
    )
    x = torch.randn(8 * 256, width, device="cuda")
    pipe.step(x, None)  # warm-up (allocator, cuBLAS handles)
    torch.cuda.synchronize()
    ex = pipe.parts.executor
    ex.cuda_events = []
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    pipe.step(x, None)
    torch.cuda.synchronize()
    spans: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    for s, _kind, _n, start, end in ex.cuda_events:
        spans[s].append((ref.elapsed_time(start), ref.elapsed_time(end)))
    overlap = sum(max(0.0, min(e0, e1) - max(b0, b1)) for b0, e0 in spans[0] for b1, e1 in spans[1])
    busy = sum(e - b for b, e in spans[0] + spans[1])
    assert overlap > 0.05 * busy, (overlap, busy, spans)


def test_gpu_streams_can_be_turned_off() -> None:
    stages, _ = probe_stages(2)
    for m in stages:
        m.cuda()
    pipe = Pipeline(
        stages,
        schedule="gpipe",
        chunks=2,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        cuda_streams=False,
    )
    assert not pipe.parts.executor.streams.cuda
