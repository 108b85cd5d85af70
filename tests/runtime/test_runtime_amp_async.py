"""Dynamic float16 loss scaling on asynchronous schedules (engine/runtime/precision.py; docs/ALGORITHMS.md,
"Mixed precision"): one GradScaler state per stage, gradients carrying the scale they were
computed under. References: torch.amp.GradScaler on the unpipelined model (one stage), a pure
Python GradScaler rule for the scales, float16 training without loss scaling for the weights,
and ``on_nonfinite="skip_update"`` for which update groups an overflow skips."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import engine
import engine.optim as eo
from engine import Pipeline

D, M = 8, 4


def _stages(S: int) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
    return [*out, nn.Linear(D, 2)]


def _sgd(p: Any) -> Any:
    return eo.SGD(p, lr=0.1, momentum=0.9)


def _batches(n: int, x_mul: float = 1.0, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * M, D, generator=g) * x_mul, torch.randn(2 * M, 2, generator=g))
            for _ in range(n)]


def _esgd(**kw: Any) -> Any:
    return lambda p: eo.SGD(p, lr=0.1, momentum=0.9, **kw)


#: every asynchronous schedule, and the mitigations (they act on the unscaled gradient)
ASYNC: dict[str, dict[str, Any]] = {
    "pb": dict(schedule="pb"),
    "pb-k2": dict(schedule="pb", update_size=2),
    "pb-sc": dict(schedule="pb", optimizer=_esgd(spike_compensation=True)),
    "pb-lwp": dict(schedule="pb", optimizer=_esgd(prediction="linear"), checkpoint="never"),
    "pb-spectrain": dict(schedule="pb", weight_prediction="spectrain",
                         optimizer=_esgd(prediction="linear")),
    "pb-t2-dc": dict(schedule="pb", optimizer=_esgd(discrepancy_correction=True,
                                                    delay_compensation=0.5)),
    "pipedream": dict(schedule="pipedream"),
    "pipedream-dc": dict(schedule="pipedream", optimizer=_esgd(delay_compensation=0.5)),
    "2bw": dict(schedule="2bw"),
}


def _make(name: str, **kw: Any) -> Pipeline:
    cfg = {"optimizer": _sgd, "loss_fn": nn.functional.mse_loss, **ASYNC[name], **kw}
    return Pipeline(_stages(3), chunks=M, autocast=torch.float16, **cfg)


def _run(pipe: Pipeline, batches: list[Any]) -> Pipeline:
    for x, y in batches:
        pipe.step(x, y)
    pipe.flush()
    return pipe


def _unscaled(pipe: Pipeline) -> Pipeline:
    """float16 without loss scaling (the device flags stay: they skip nothing here)."""
    pipe.parts.executor.loss_scaler = None
    for st in pipe.stages:
        st.loss_scaler = None
    return pipe


def _params(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach() for st in pipe.stages for p in st.module.parameters()]


def _grad_scaler_rule(scale: float, tracker: int, found: bool, opts: dict[str, Any]) -> tuple[float, int]:
    """torch.amp.GradScaler.update, written out (the reference for the per-stage scales)."""
    if found:
        return scale * opts.get("backoff_factor", 0.5), 0
    tracker += 1
    if tracker == opts.get("growth_interval", 2000):
        return scale * opts.get("growth_factor", 2.0), 0
    return scale, tracker


@pytest.mark.parametrize("schedule,k", [("pb", 1), ("pb", 2), ("pipedream", 4)])
def test_one_stage_equals_grad_scaler_on_the_unpipelined_model(schedule: str, k: int) -> None:
    """One stage: each update group is one GradScaler step over its k micro-batches; large
    scales overflow float16 now and then, so groups are skipped and the scale backs off, then
    grows every 2 clean groups -- the same scales, skips and weights, bit for bit."""
    opts = dict(init_scale=2.0**16, growth_interval=2)
    batches = _batches(4, seed=1)
    pipe = _run(Pipeline(_stages(1), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                         optimizer=_sgd, autocast=torch.float16, grad_scaler=opts,
                         update_size=k), batches)
    assert pipe.spec.update_size == k and pipe.delays == [0]  # (2bw has delay 1 with one stage)
    ref = copy.deepcopy(_stages(1)[0])
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **opts)
    mbs = [(xm, ym) for x, y in batches for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
    skipped = 0
    for g in range(0, len(mbs), k):
        opt.zero_grad()
        for xm, ym in mbs[g:g + k]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(ref(xm), ym)
            scaler.scale(loss * (1.0 / k) if k > 1 else loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    stats = pipe.stats()
    assert 0 < skipped < len(mbs) // k  # the run both skips and trains
    assert stats["amp_skipped_updates"] == [skipped]
    assert float(stats["loss_scale"][0]) == scaler.get_scale()
    for p, q in zip(pipe.stages[0].module.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("schedule", ["pb", "pipedream", "2bw"])
def test_scales_grow_per_stage_by_grad_scaler_rule(schedule: str) -> None:
    """No overflow, growth every 2 groups: each stage's scale follows GradScaler's rule over
    its own updates, and the weights equal float16 training without loss scaling up to
    float16's rounding."""
    opts = dict(init_scale=2.0**4, growth_interval=2)
    batches = _batches(6)

    def make() -> Pipeline:
        return Pipeline(_stages(3), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                        optimizer=_sgd, autocast=torch.float16, grad_scaler=opts)

    scaled = _run(make(), batches)
    plain = _run(_unscaled(make()), batches)
    stats = scaled.stats()
    assert stats["amp_skipped_updates"] == [0, 0, 0]
    for s, u in enumerate(stats["updates"]):
        want, tracker = opts["init_scale"], 0
        for _ in range(u):
            want, tracker = _grad_scaler_rule(want, tracker, False, opts)
        assert float(stats["loss_scale"][s]) == want > opts["init_scale"], (s, u)
    for p, q in zip(_params(scaled), _params(plain), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(ASYNC))
def test_a_gradient_from_a_stage_at_another_scale_is_rescaled(name: str) -> None:
    """Stages whose scales differ (as after different overflow histories; set here through
    the checkpoint): every gradient crossing a boundary is moved from the sender's scale to
    the receiver's (times S_s / c), so the weights still equal float16 training without loss
    scaling up to float16's rounding; left at the sender's scale, stage 0 and 1 would step
    with gradients 4x and 16x too large."""
    opts = dict(init_scale=2.0**4, growth_interval=1000)
    batches = _batches(4)

    def make() -> Pipeline:
        return _make(name, grad_scaler=opts)

    scaled = make()
    state = scaled.state_dict()
    state["loss_scaler"]["stage_scale"] = torch.tensor([2.0**4, 2.0**6, 2.0**8])
    scaled.load_state_dict(state)
    _run(scaled, batches)
    plain = _run(_unscaled(make()), batches)
    assert [float(v) for v in scaled.stats()["loss_scale"]] == [2.0**4, 2.0**6, 2.0**8]
    assert scaled.stats()["amp_skipped_updates"] == [0, 0, 0]
    for p, q in zip(_params(scaled), _params(plain), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(ASYNC))
def test_an_overflow_skips_the_groups_skip_update_skips(name: str) -> None:
    """One micro-batch whose scaled gradient overflows float16 at every stage: each stage skips
    exactly the update group holding it and backs off once -- the groups that
    ``on_nonfinite="skip_update"`` skips for a non-finite loss of that micro-batch (the
    reference, without loss scaling); every other group trains as without loss scaling."""
    batches = _batches(4)
    bad = 1, 2  # (step, micro-batch)
    x, y = batches[bad[0]]
    y = y.clone()
    rows = slice(bad[1] * 2, bad[1] * 2 + 2)
    y[rows] = 1.0e4  # finite in float32; times the scale, its gradient overflows float16
    batches[bad[0]] = (x, y)
    opts = dict(init_scale=2.0**10, growth_interval=1000)
    scaled = _run(_make(name, grad_scaler=opts), batches)

    def poisoned(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, target)
        return loss * float("nan") if target.abs().max() > 1.0e3 else loss

    ref = _run(_unscaled(_make(name, loss_fn=poisoned, on_nonfinite="skip_update")), batches)
    stats = scaled.stats()
    assert stats["amp_skipped_updates"] == [1, 1, 1] == ref.stats()["skipped_updates"]
    assert [float(v) for v in stats["loss_scale"]] == [2.0**9] * 3
    for p, q in zip(_params(scaled), _params(ref), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_resume_in_flight_keeps_every_stage_scale(tmp_path: Any) -> None:
    """Saved mid-run (micro-batches in flight, scales moving every group) and loaded into a
    fresh pipeline: the run continues bit for bit, the carried scales included."""
    opts = dict(init_scale=2.0**12, growth_interval=1)  # grows each group until it overflows
    batches = _batches(6, x_mul=10.0, seed=3)

    def make() -> Pipeline:
        return Pipeline(_stages(3), schedule="pipedream", chunks=M, loss_fn=nn.functional.mse_loss,
                        optimizer=_sgd, autocast=torch.float16, grad_scaler=opts)

    whole = _run(make(), batches)
    first = make()
    for x, y in batches[:3]:
        first.step(x, y)
    engine.save(first, tmp_path / "c.safetensors")
    before = first.stats()["amp_skipped_updates"]  # (counters since the pipeline was built)
    resumed = make()
    engine.load(resumed, tmp_path / "c.safetensors")
    _run(resumed, batches[3:])
    a, b = resumed.stats(), whole.stats()
    assert [u + v for u, v in zip(before, a["amp_skipped_updates"], strict=True)] == b["amp_skipped_updates"]
    assert min(a["amp_skipped_updates"]) > 0 and min(before) > 0
    assert all(torch.equal(u, v) for u, v in zip(a["loss_scale"], b["loss_scale"], strict=True))
    assert all(torch.equal(p, q) for p, q in zip(_params(resumed), _params(whole), strict=True))
