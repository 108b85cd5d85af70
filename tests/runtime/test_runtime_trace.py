"""``pipe.trace(path)`` (engine/runtime/stage/trace.py): a Chrome/Perfetto trace-event file of the
executed actions, valid against the Trace Event Format, with one event per action of the
run's own action log, named as the profiler labels, and results unchanged by tracing."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.runtime.stage import trace as trace_mod
from engine.trace_events import validate as validate_trace_events

D, M = 4, 4


def _pipe(schedule: str, **kw) -> Pipeline:
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)] + [nn.Linear(D, 2)]
    return Pipeline(stages, schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.05), **kw)


def _data(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(2 * M, D, generator=g), torch.randn(2 * M, 2, generator=g)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1", "pb", "pipedream"])
def test_trace_has_one_event_per_executed_action(schedule: str, tmp_path: Path) -> None:
    pipe, ref = _pipe(schedule), _pipe(schedule)
    pipe.parts.executor.log = []
    path = tmp_path / "trace.json"
    with pipe.trace(path):
        for t in range(3):
            pipe.step(*_data(t))
        pipe.flush()
    for t in range(3):
        ref.step(*_data(t))
    ref.flush()
    doc = json.loads(path.read_text())
    assert validate_trace_events(doc) == []
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    kinds = {"F": "forward", "B": "backward", "W": "weight", "U": "update"}
    # every action the executor logged appears once, on its stage's track
    assert len(events) == len(pipe.parts.executor.log) > 0
    per_stage = sorted((e["tid"], e["cat"]) for e in events)
    logged = sorted((s, kinds[str(a)[0]]) for s, a in pipe.parts.executor.log)
    assert per_stage == logged
    for e in events:
        assert e["name"].startswith(f"stage{e['tid']}/")
        assert e["cat"] in kinds.values()
        if e["cat"] != "update":
            assert isinstance(e["args"]["micro_batch"], int)
            assert isinstance(e["args"]["live_version"], int)
        else:
            assert e["args"]["micro_batches"] and isinstance(e["args"]["version"], int)
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert names == {"process_name", "thread_name"}
    # tracing changes nothing
    for a, b in zip(pipe.stages, ref.stages, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters(),
                                                     strict=True))
    assert trace_mod.ACTIVE is None  # recording stopped with the block


def test_trace_records_forward_versions(tmp_path: Path) -> None:
    """pipedream's forward reads the version it stashes: args say which."""
    pipe = _pipe("pipedream")
    with pipe.trace(tmp_path / "t.json"):
        for t in range(4):
            pipe.step(*_data(t))
    doc = json.loads((tmp_path / "t.json").read_text())
    fwd = [e for e in doc["traceEvents"] if e.get("cat") == "forward"]
    assert {e["args"]["version_read"] for e in fwd} >= {0, 1}
    assert all(e["args"]["version_read"] <= e["args"]["live_version"] for e in fwd)


def test_validator_catches_malformed_events() -> None:
    assert validate_trace_events([]) != []
    bad = {"traceEvents": [{"name": "x", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0, "dur": -1},
                           {"name": 3, "ph": "Q", "pid": "0", "tid": 0, "ts": "a"}]}
    problems = validate_trace_events(bad)
    assert any("dur" in p for p in problems) and any("unknown ph" in p for p in problems)
    assert any("pid" in p for p in problems) and any("ts" in p for p in problems)


def test_a_second_trace_in_the_same_process_is_refused(tmp_path: Path) -> None:
    pipe = _pipe("gpipe")
    with pipe.trace(tmp_path / "a.json"):
        with pytest.raises(RuntimeError, match="already"):
            with pipe.trace(tmp_path / "b.json"):
                pass
    assert (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


def test_a_trace_never_entered_warns_and_writes_nothing(tmp_path: Path) -> None:
    """``pipe.trace(path)`` as a statement records nothing: it says so when discarded."""
    pipe = _pipe("1f1b")
    path = tmp_path / "t.json"
    with pytest.warns(RuntimeWarning, match=r"pipe\.trace\('.*t\.json'\) was never entered.*with pipe\.trace"):
        pipe.trace(path)
        gc.collect()
    pipe.step(*_data(0))
    assert not path.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # entered: no warning, and the file is written
        block = pipe.trace(path)
        with block:
            pipe.step(*_data(1))
        del block
        gc.collect()
    assert validate_trace_events(json.loads(path.read_text())) == []


def test_readme_features_snippet_runs(tmp_path: Path, monkeypatch: Any) -> None:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text()
    start = text.index("## Clipping, mixed precision, offload, traces")
    block = text[start:].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"])
    doc = json.loads((tmp_path / "pipeline_trace.json").read_text())
    assert validate_trace_events(doc) == []
    stats = scope["stats"]
    assert isinstance(stats["grad_norm"][0], torch.Tensor)
    assert all(a["host_peak"] > 0 for a in stats["activation_bytes"])
