"""Mixed precision (engine/runtime/precision.py): ``autocast=torch.bfloat16`` equals torch.autocast on
the unpipelined model, and ``autocast=torch.float16`` equals torch.autocast with
torch.amp.GradScaler -- the same steps skipped, the same scale, the same weights bit for bit on
CPU -- for every recomputation mode, with clipping, torch.optim and engine.optim optimizers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import Pipeline
from engine.errors import PipelineConfigError

D, M = 8, 4


def _stages(S: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    return [*out, nn.Linear(D, 2)]


OPTS = {
    "torch": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "engine": lambda p: eo.SGD(p, lr=0.1, momentum=0.9),
}
SCALER = dict(init_scale=2.0**20, growth_interval=2)


def _reference(stages: list[nn.Module], dtype: torch.dtype, clip: float | None,
               batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[nn.Module, list[float]]:
    """torch's own recipe on the unpipelined model, micro-batch by micro-batch."""
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if dtype is torch.float16 else None
    scales = []
    for x, y in batches:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(ref(xm), ym)
            root = loss * (1.0 / M)
            (scaler.scale(root) if scaler is not None else root).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    return ref, scales


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # large inputs: float16 gradients overflow at the first scales, so steps are skipped
    return [(torch.randn(2 * M, D, generator=g) * 100, torch.randn(2 * M, 2, generator=g))
            for _ in range(n)]


#: every dtype with every schedule; recomputation modes, clipping and optimizers across them
CASES = [
    (dtype, schedule, ["never", "except_last", "always"][(k + d) % 3], [None, 1.0][k % 2],
     sorted(OPTS)[(k + d) % 2])
    for d, dtype in enumerate([torch.bfloat16, torch.float16])
    for k, schedule in enumerate(["gpipe", "1f1b", "zbh1", "1f1b"])
]


@pytest.mark.parametrize("dtype,schedule,checkpoint,clip,opt", CASES)
def test_autocast_equals_torch_amp_on_the_unpipelined_model(
    dtype: torch.dtype, schedule: str, checkpoint: str, clip: float | None, opt: str
) -> None:
    stages = _stages(3)
    batches = _batches(6)
    ref, scales = _reference(stages, dtype, clip, batches)
    kw: dict[str, Any] = {"grad_scaler": SCALER} if dtype is torch.float16 else {}
    pipe = Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=OPTS[opt], autocast=dtype, checkpoint=checkpoint,
                    clip_grad_norm=clip, **kw)
    got = []
    for x, y in batches:
        pipe.step(x, y)
        if dtype is torch.float16:
            got.append(float(pipe.stats()["loss_scale"]))
    mine = [p for st in stages for p in st.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, ref.parameters(), strict=True))
    assert got == scales
    stats = pipe.stats()
    if dtype is torch.float16:
        skipped = sum(1 for a, b in zip([SCALER["init_scale"], *scales], scales) if b < a)
        assert stats["amp_skipped_steps"] == skipped > 0  # the test skips, as GradScaler did
    else:
        assert stats["loss_scale"] is None


def test_stage_functions_run_under_autocast() -> None:
    """Activations between stages are what autocast made (bfloat16 here), also when the
    forward is recomputed inside the backward."""
    seen: list[tuple[torch.dtype, bool]] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, 2)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            seen.append((h.dtype, torch.is_autocast_enabled("cpu")))
            return self.lin(h)

    stages = [nn.Sequential(nn.Linear(D, D), nn.Tanh()), Probe()]
    pipe = Pipeline(stages, schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                    optimizer=OPTS["torch"], autocast=torch.bfloat16, checkpoint="always")
    pipe.step(torch.randn(4, D), torch.randn(4, 2))
    assert len(seen) == 5  # the first step's dry run, 2 forwards, 2 recomputations
    assert all(s == (torch.bfloat16, True) for s in seen)
    assert all(p.dtype == torch.float32 for st in stages for p in st.parameters())


def test_float16_on_an_asynchronous_schedule_refuses_what_it_cannot_do() -> None:
    with pytest.raises(PipelineConfigError, match="found_inf"):
        Pipeline(_stages(2), schedule="pb", chunks=2, loss_fn=nn.functional.mse_loss,
                 autocast=torch.float16, optimizer=OPTS["torch"])


def _async_fp16(schedule: str, scale: float | None, batches: list[Any], **kw: Any) -> Pipeline:
    extra: dict[str, Any] = {"grad_scaler": {"init_scale": scale}} if scale is not None else {}
    pipe = Pipeline(_stages(3), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=OPTS["engine"], autocast=torch.float16, **extra, **kw)
    if scale is None:  # the reference: float16 without loss scaling
        pipe.parts.executor.loss_scaler = None
        for st in pipe.stages:
            st.loss_scaler = None
    for x, y in batches:
        pipe.step(x, y)
    pipe.flush()
    return pipe


@pytest.mark.parametrize("scale", [1.0, 2.0**6])
@pytest.mark.parametrize("schedule", ["pb", "pipedream", "2bw"])
def test_asynchronous_float16_scale_without_overflow(schedule: str, scale: float) -> None:
    """(Dynamic scaling that never moves in 4 steps.) Scaling by a power of two and back changes no value except where a float16 gradient is
    subnormal (what loss scaling is for): S = 1 equals float16 training without loss scaling
    bit for bit (the device-flag path changes nothing), S = 64 to float16's rounding."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2 * M, D, generator=g), torch.randn(2 * M, 2, generator=g))
               for _ in range(4)]
    scaled = _async_fp16(schedule, scale, batches, clip_grad_norm=0.5)
    plain = _async_fp16(schedule, None, batches, clip_grad_norm=0.5)
    assert scaled.stats()["amp_skipped_updates"] == [0, 0, 0]
    for a, b in zip(scaled.stages, plain.stages, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            if scale == 1.0:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_asynchronous_float16_skips_each_overflowing_update_group() -> None:
    """With a scale that overflows float16 every group is skipped whole, on the device: no
    weight moves, every stage counts its skipped groups, and the steps go on."""
    stages_before = [p.detach().clone() for st in _stages(3) for p in st.parameters()]
    pipe = _async_fp16("pb", 2.0**40, _batches(3))
    after = [p.detach() for st in pipe.stages for p in st.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(stages_before, after, strict=True))
    stats = pipe.stats()
    assert stats["amp_skipped_updates"] == stats["updates"] and min(stats["updates"]) > 0


def test_bfloat16_on_an_asynchronous_schedule_runs_under_autocast() -> None:
    """bfloat16 needs no loss scale: pb trains; its losses equal an fp32 run's up to bf16."""
    losses = {}
    for dtype in (None, torch.bfloat16):
        pipe = Pipeline(_stages(2), schedule="pb", chunks=2, loss_fn=nn.functional.mse_loss,
                        optimizer=OPTS["engine"], autocast=dtype)
        x, y = torch.randn(4, D), torch.randn(4, 2)
        losses[dtype] = pipe.step(x, y)
    assert not torch.equal(losses[None], losses[torch.bfloat16])
    torch.testing.assert_close(losses[None], losses[torch.bfloat16], rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "kw,word",
    [
        ({"autocast": torch.float32}, "autocast"),
        ({"autocast": "bf16"}, "autocast"),
        ({"autocast": torch.float16, "grad_scaler": {"init": 1.0}}, "unknown"),
        ({"autocast": torch.float16, "grad_scaler": {"backoff_factor": 2.0}}, "backoff_factor"),
        ({"autocast": torch.float16, "grad_scaler": {"growth_interval": 0}}, "growth_interval"),
        ({"autocast": torch.bfloat16, "grad_scaler": {"init_scale": 8.0}}, "float16"),
        ({"grad_scaler": [1]}, "grad_scaler"),
    ],
)
def test_bad_precision_options_are_refused(kw: dict[str, Any], word: str) -> None:
    with pytest.raises(PipelineConfigError, match=word):
        Pipeline(_stages(2), schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                 optimizer=OPTS["torch"], **kw)


def test_float16_resume_keeps_the_loss_scale(tmp_path: Any) -> None:
    """A float16 run saved and loaded continues as the uninterrupted one: the scale and its
    growth tracker are part of the checkpoint."""
    import engine

    batches = _batches(6)

    def make() -> Pipeline:
        return Pipeline(_stages(3), schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
                        optimizer=OPTS["engine"], autocast=torch.float16, grad_scaler=SCALER)

    whole = make()
    for x, y in batches:
        whole.step(x, y)
    first = make()
    for x, y in batches[:3]:
        first.step(x, y)
    engine.save(first, tmp_path / "c.safetensors")
    resumed = make()
    engine.load(resumed, tmp_path / "c.safetensors")
    assert torch.equal(resumed.stats()["loss_scale"], first.stats()["loss_scale"])
    for x, y in batches[3:]:
        resumed.step(x, y)
    assert torch.equal(resumed.stats()["loss_scale"], whole.stats()["loss_scale"])
    for a, b in zip(resumed.stages, whole.stages, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters(),
                                                     strict=True))
    bf16 = Pipeline(_stages(3), schedule="1f1b", chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=OPTS["engine"], autocast=torch.bfloat16)
    with pytest.raises(PipelineConfigError, match="loss scaling"):
        engine.load(bf16, tmp_path / "c.safetensors")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_evaluate_runs_under_the_pipelines_autocast(dtype: torch.dtype, schedule: str) -> None:
    """evaluate() equals torch.autocast around the unpipelined model's forward, bit for bit
    (and is not the float32 forward), after training steps."""
    kw: dict[str, Any] = {} if dtype is torch.bfloat16 else {"grad_scaler": SCALER}
    pipe = Pipeline(_stages(3), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=OPTS["engine"], autocast=dtype, **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        pipe.step(torch.randn(2 * M, D, generator=g), torch.randn(2 * M, 2, generator=g))
    x = torch.randn(7, D, generator=g)
    out = pipe.evaluate(x)
    whole = nn.Sequential(*[st.module for st in pipe.stages])
    with torch.no_grad():
        plain = torch.cat([whole(c) for c in x.chunk(M)])
        with torch.autocast("cpu", dtype=dtype):
            ref = torch.cat([whole(c) for c in x.chunk(M)])
    assert out.dtype == dtype and torch.equal(out, ref)
    assert not torch.equal(out.float(), plain)
