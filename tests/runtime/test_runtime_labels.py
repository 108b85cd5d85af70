"""Profiler labels cost nothing when no profiler records: an action enters record_function
(a dispatcher round trip on enter and exit, ~25 us per action measured on 2 cores) only while
a profiler is on. With one, every action keeps its 'stage{s}/{kind}{n}' label
(tests/runtime/test_runtime_sync.py::test_record_function_labels)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import engine.runtime.stage.stage as stage_mod
import engine.runtime.stage.stage_update as stage_update_mod
from engine import Pipeline


def _pipe() -> Pipeline:
    torch.manual_seed(0)
    return Pipeline(
        [nn.Linear(4, 4), nn.Linear(4, 2)],
        schedule="1f1b",
        chunks=2,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )


def test_no_record_function_without_a_profiler(monkeypatch: Any) -> None:
    calls: list[str] = []
    real = stage_mod.record_function

    def counting(name: str) -> Any:
        calls.append(name)
        return real(name)

    monkeypatch.setattr(stage_mod, "record_function", counting)
    monkeypatch.setattr(stage_update_mod, "record_function", counting)  # (the U labels)
    pipe = _pipe()
    pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    assert calls == []

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    assert {"stage0/F2", "stage1/B3", "stage0/U1"} <= set(calls)
