"""The step features on a GPU (marked ``cuda``; skipped on CPU machines): what the CPU tests
cannot prove -- clipping and float16 loss scaling on device tensors across CUDA stage
streams (no host read: found_inf and the norm stay on the device), pinned-memory offload with
non-blocking copies, and a trace with stage streams."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import Pipeline
from engine.trace_events import validate as validate_trace_events

pytestmark = pytest.mark.cuda

D, M = 32, 4


def _stages(S: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(S - 1)]
    return [m.cuda() for m in [*out, nn.Linear(D, 4)]]


def _batches(n: int, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [(torch.randn(2 * M, D, device="cuda", generator=g) * scale,
             torch.randn(2 * M, 4, device="cuda", generator=g)) for _ in range(n)]


def test_clip_and_float16_on_cuda_streams_equal_torch_amp() -> None:
    stages = _stages()
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**20, growth_interval=2)
    pipe = Pipeline(stages, schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9), autocast=torch.float16,
                    grad_scaler=dict(init_scale=2.0**20, growth_interval=2), clip_grad_norm=0.5,
                    cuda_streams=True)
    assert pipe.parts.streams.cuda
    for x, y in _batches(6, scale=50.0):
        pipe.step(x, y)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(ref(xm), ym)
            scaler.scale(loss * (1.0 / M)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    stats = pipe.stats()
    assert float(stats["loss_scale"]) == scaler.get_scale()
    assert stats["amp_skipped_steps"] > 0
    assert stats["grad_norm"][0].is_cuda
    mine = [p for st in stages for p in st.parameters()]
    for a, b in zip(mine, ref.parameters(), strict=True):  # fused kernels vs torch: rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["1f1b", "pb", "pipedream"])
def test_pinned_offload_equals_no_offload(schedule: str) -> None:
    out = []
    for offload in (False, True):
        pipe = Pipeline(_stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9), checkpoint="never",
                        offload_activations=offload)
        for x, y in _batches(4):
            pipe.step(x, y)
        pipe.flush()
        out.append([p.detach().clone() for st in pipe.stages for p in st.module.parameters()])
        if offload:
            act = pipe.stats()["activation_bytes"]
            assert all(a["host_peak"] > 0 and a["host_now"] == 0 for a in act)
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_trace_with_cuda_stage_streams(tmp_path: Path) -> None:
    pipe = Pipeline(_stages(), schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: eo.SGD(p, lr=0.05), cuda_streams=True)
    with pipe.trace(tmp_path / "t.json"):
        for x, y in _batches(2):
            pipe.step(x, y)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert validate_trace_events(doc) == []
    assert {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}
