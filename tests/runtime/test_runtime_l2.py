"""``Pipeline(l2_persistence=...)``: one persisting-L2 set-aside per GPU split across the stages,
one window per stage stream (engine/runtime/setup/l2.py).

On CPU: the option is validated, reported unsupported (0 bytes and a reason, one warning)
and changes nothing; the split is a pure function tested with made-up sizes; the wiring
(set-aside once to the sum, a window per stage stream, re-set when live moves, given back
with the pipeline) is tested against a fake device layer. The real windows need a GPU
(``cuda`` marker).
"""

from __future__ import annotations

import gc
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import engine.arena.l2 as arena_l2
from engine import Pipeline
from engine.errors import PipelineConfigError
from engine.runtime.setup.l2 import apply_l2, check_l2_option, split_budget

MiB = 1 << 20


def _stages(device: str = "cpu") -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(16, 32), nn.Tanh()).to(device),
        nn.Sequential(nn.Linear(32, 16), nn.Tanh()).to(device),
        nn.Linear(16, 4).to(device),
    ]


def _pipe(device: str = "cpu", **kw: Any) -> Pipeline:
    kw.setdefault("schedule", "1f1b")
    return Pipeline(
        _stages(device),
        chunks=4,
        loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        **kw,
    )


def _train(pipe: Pipeline, device: str = "cpu", steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        losses.append(pipe.step(x.to(device), y.to(device)).detach().cpu())
    pipe.flush()
    return losses


# ----------------------------------------------------------------------------- the split


def test_split_is_proportional_capped_and_never_over_budget() -> None:
    assert split_budget(4 * MiB, [3 * MiB, 1 * MiB]) == [3 * MiB, 1 * MiB]  # exact fit
    assert split_budget(2 * MiB, [3 * MiB, 1 * MiB]) == [3 * MiB // 2, MiB // 2]
    assert split_budget(100 * MiB, [3 * MiB, 1 * MiB, 0]) == [3 * MiB, 1 * MiB, 0]  # capped
    assert split_budget(0, [5, 7]) == [0, 0]
    assert split_budget(10, [0, 0]) == [0, 0]
    assert split_budget(10, []) == []
    assert split_budget(10, [3, 3, 3, 3]) == [2, 2, 2, 2]  # rounded down, sum <= budget
    with pytest.raises(ValueError, match=">= 0"):
        split_budget(10, [-1, 3])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=g))
        sizes = [int(v) for v in torch.randint(0, 1 << 24, (n,), generator=g)]
        budget = int(torch.randint(0, 1 << 26, (1,), generator=g))
        shares = split_budget(budget, sizes)
        assert sum(shares) <= budget
        assert all(0 <= sh <= sz for sh, sz in zip(shares, sizes, strict=True))
        if budget >= sum(sizes):
            assert shares == sizes
        else:  # proportional, up to rounding down
            total = sum(sizes)
            assert all(abs(sh - budget * sz / total) < 1 for sh, sz in zip(shares, sizes, strict=True))


@pytest.mark.parametrize("value, fraction", [(False, 0.0), (None, 0.0), (True, 1.0), (0.25, 0.25), (1, 1.0)])
def test_option_values(value: object, fraction: float) -> None:
    assert check_l2_option(value) == fraction


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, 2, "yes", [0.5]])
def test_invalid_option_values_are_refused_before_anything_is_built(value: object) -> None:
    with pytest.raises(PipelineConfigError, match="l2_persistence=.*fraction in \\(0, 1\\]"):
        _pipe(l2_persistence=value)


def test_option_refused_where_the_runtime_cannot_set_windows() -> None:
    with pytest.raises(PipelineConfigError, match="cuda_streams=False"):
        _pipe(l2_persistence=True, cuda_streams=False)
    with pytest.raises(PipelineConfigError, match="transport='gloo'.*set_l2_persistence"):
        _pipe(l2_persistence=True, transport="gloo")


# ----------------------------------------------------------------------------- CPU: reported, not faked


def test_off_by_default_reports_zero_bytes() -> None:
    pipe = _pipe()
    st = pipe.stats()
    assert st["l2_persisting_bytes"] == [0, 0, 0]
    assert st["l2_persistence"] == {
        "requested": 0.0,
        "set_aside_bytes": 0,
        "max_persisting_bytes": 0,
        "reason": "off (l2_persistence=False)",
    }


def test_cpu_pipeline_reports_unsupported_warns_once_and_changes_nothing() -> None:
    reference = _pipe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = _pipe(l2_persistence=0.5)
    ours = [w for w in caught if "l2_persistence" in str(w.message)]
    assert len(ours) == 1 and "unsupported" in str(ours[0].message) and "cpu" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the user's code, not the runtime
    st = pipe.stats()
    assert st["l2_persisting_bytes"] == [0, 0, 0]
    info = st["l2_persistence"]
    assert info["requested"] == 0.5 and info["set_aside_bytes"] == 0
    assert "cpu" in info["reason"] and "CUDA" in info["reason"]
    assert pipe.parts.streams.cuda is False  # no stage streams were forced on
    assert all(st.store.on_live_moved is None for st in pipe.stages)
    # training is the same, bit for bit
    assert [loss.item() for loss in _train(pipe)] == [loss.item() for loss in _train(reference)]
    for a, b in zip(pipe.stages, reference.stages, strict=True):
        for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True):
            assert torch.equal(p, q)


# ----------------------------------------------------------------------------- the wiring (fake device)


class _FakeArena:
    def __init__(self, sizes: list[int], fail: str = "") -> None:
        self.buckets = [SimpleNamespace(nbytes=n) for n in sizes]
        self.fail = fail
        self.windows: list[tuple[int, Any]] = []

    def set_l2_window(self, *, share_bytes: int, stream: Any) -> Any:
        self.windows.append((share_bytes, stream))
        return SimpleNamespace(ok=not self.fail, reason=self.fail)


class _Owner:
    pass


def _fake(monkeypatch: pytest.MonkeyPatch, arenas: list[Any], *, max_persisting: int = 8 * MiB,
          max_window: int = 128 * MiB, grant: Any = None, reason: str = "",
          granule: int = 1) -> dict[str, list]:
    calls: dict[str, list] = {"set_aside": [], "reset": [], "clear": []}

    def device_limits(device: int) -> dict[str, Any]:
        return {"supported": True, "max_persisting_bytes": max_persisting,
                "max_window_bytes": max_window, "set_aside_bytes": 0, "reason": reason}

    def set_aside(device: int, nbytes: int) -> dict[str, Any]:
        calls["set_aside"].append(nbytes)
        if grant == "refuse":
            return {"ok": False, "granted_bytes": 0, "reason": "refused by MIG"}
        got = nbytes if grant is None else min(grant, nbytes)
        return {"ok": True, "granted_bytes": -(-got // granule) * granule, "reason": ""}

    monkeypatch.setattr(arena_l2, "device_limits", device_limits)
    monkeypatch.setattr(arena_l2, "set_aside", set_aside)
    monkeypatch.setattr(arena_l2, "reset", lambda device: calls["reset"].append(device))
    monkeypatch.setattr(arena_l2, "clear_window", lambda device, s: calls["clear"].append(s))
    stages = [
        SimpleNamespace(index=i, store=SimpleNamespace(arena=a, params=[], on_live_moved=None))
        for i, a in enumerate(arenas)
    ]
    streams = SimpleNamespace(
        cuda=True,
        device=torch.device("cuda", 0),
        streams={i: SimpleNamespace(cuda_stream=1000 + i) for i in range(len(arenas))},
    )
    calls["stages"], calls["streams"] = stages, streams  # type: ignore[assignment]
    return calls


def test_set_aside_is_set_once_to_the_sum_and_each_stage_window_gets_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arenas = [_FakeArena([6 * MiB, 1 * MiB]), None, _FakeArena([2 * MiB])]  # stage 1: no weights
    calls = _fake(monkeypatch, arenas, max_persisting=4 * MiB)
    owner = _Owner()
    state = apply_l2(calls["stages"], calls["streams"], 1.0, owner)
    # sizes: 6 MiB (largest bucket), 0, 2 MiB; budget 4 MiB -> 3 : 0 : 1
    assert state.granted == [3 * MiB, 0, 1 * MiB]
    assert calls["set_aside"] == [4 * MiB]  # once, the sum
    assert state.set_aside == 4 * MiB and state.reason == ""
    streams = calls["streams"].streams
    assert arenas[0].windows == [(3 * MiB, streams[0])]
    assert arenas[2].windows == [(1 * MiB, streams[2])]
    # a window follows live when it moves (swap_live at a retirement)
    calls["stages"][0].store.on_live_moved()
    assert arenas[0].windows[-1] == (3 * MiB, streams[0])
    assert calls["stages"][1].store.on_live_moved is None
    # given back with the pipeline: both windows cleared, the set-aside reset
    del owner
    gc.collect()
    assert sorted(calls["clear"]) == [1000, 1002] and calls["reset"] == [0]


def test_fraction_and_window_cap_shape_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    arenas = [_FakeArena([3 * MiB]), _FakeArena([1 * MiB])]
    calls = _fake(monkeypatch, arenas, max_persisting=8 * MiB, max_window=2 * MiB)
    state = apply_l2(calls["stages"], calls["streams"], 0.25, _Owner())
    # budget 2 MiB over sizes min(3, 2) = 2 MiB and 1 MiB
    assert state.granted == [2 * MiB * 2 // 3, 2 * MiB // 3]
    assert calls["set_aside"] == [sum(state.granted)] and state.requested == 0.25


def test_a_smaller_grant_is_split_again(monkeypatch: pytest.MonkeyPatch) -> None:
    arenas = [_FakeArena([3 * MiB]), _FakeArena([1 * MiB])]
    calls = _fake(monkeypatch, arenas, max_persisting=4 * MiB, grant=2 * MiB)
    state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [3 * MiB // 2, MiB // 2] and state.set_aside == 2 * MiB


def test_refusals_are_reported_with_zero_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    arenas = [_FakeArena([3 * MiB]), _FakeArena([1 * MiB])]
    calls = _fake(monkeypatch, arenas, reason="this GPU has no persisting L2 set-aside")
    with pytest.warns(UserWarning, match="no persisting L2"):
        state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [0, 0] and calls["set_aside"] == [] and "no persisting" in state.reason
    calls = _fake(monkeypatch, arenas, grant="refuse")
    with pytest.warns(UserWarning, match="refused by MIG"):
        state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [0, 0] and state.set_aside == 0 and arenas[0].windows == []


def test_a_failed_window_gives_its_share_back(monkeypatch: pytest.MonkeyPatch) -> None:
    arenas = [_FakeArena([3 * MiB]), _FakeArena([1 * MiB], fail="default stream")]
    calls = _fake(monkeypatch, arenas, max_persisting=4 * MiB)
    with pytest.warns(UserWarning, match="stage 1: default stream"):
        state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [3 * MiB, 0]
    assert calls["set_aside"] == [4 * MiB, 3 * MiB] and state.set_aside == 3 * MiB
    assert calls["stages"][1].store.on_live_moved is None


def test_a_set_aside_rounded_up_is_reported_as_the_device_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The H100 rounds the set-aside up to its granularity: 5,120 bytes asked, 3,276,800
    held (issue 22). The stages keep the shares they asked for; set_aside_bytes says what
    the device holds, also after a failed window gave its share back."""
    granule = 3_276_800
    arenas = [_FakeArena([4096]), _FakeArena([1024])]
    calls = _fake(monkeypatch, arenas, max_persisting=40 * MiB, granule=granule)
    state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [4096, 1024] and calls["set_aside"] == [5120]
    assert state.set_aside == granule and state.stats()["set_aside_bytes"] == granule
    arenas = [_FakeArena([4096]), _FakeArena([1024], fail="default stream")]
    calls = _fake(monkeypatch, arenas, max_persisting=40 * MiB, granule=granule)
    with pytest.warns(UserWarning, match="stage 1"):
        state = apply_l2(calls["stages"], calls["streams"], 1.0, _Owner())
    assert state.granted == [4096, 0] and calls["set_aside"] == [5120, 4096]
    assert state.set_aside == granule


# ----------------------------------------------------------------------------- real windows (GPU)


def _live_window_bucket(stage: Any) -> torch.Tensor:
    arena = stage.store.arena
    best = max(arena.buckets, key=lambda b: b.nbytes)
    return arena.flat_param(best.index)


def _needs_persisting_l2() -> dict[str, Any]:
    limits = arena_l2.device_limits(torch.cuda.current_device())
    if not limits["supported"] or limits["reason"]:
        pytest.skip(f"no persisting L2 here: {limits['reason']}")
    return limits


@pytest.mark.cuda
def test_cuda_pipeline_splits_the_set_aside_and_sets_a_window_per_stage_stream() -> None:
    limits = _needs_persisting_l2()
    dev = torch.cuda.current_device()
    reference = _train(_pipe("cuda"), "cuda")
    pipe = _pipe("cuda", l2_persistence=0.5)
    got = pipe.stats()["l2_persisting_bytes"]
    info = pipe.stats()["l2_persistence"]
    sizes = [
        min(limits["max_window_bytes"], max(b.nbytes for b in st.store.arena.buckets))
        for st in pipe.stages
    ]
    asked = split_budget(int(0.5 * limits["max_persisting_bytes"]), sizes)
    assert info["reason"] == "" and all(g > 0 for g in got)
    assert all(g <= a for g, a in zip(got, asked, strict=True))  # the device may round down
    # the device rounds the set-aside up to its granularity (H100: 5,120 asked, 3,276,800 held)
    assert info["set_aside_bytes"] == arena_l2.device_limits(dev)["set_aside_bytes"] >= sum(got)
    handles = []
    for s, st in enumerate(pipe.stages):
        handle = int(pipe.parts.streams.streams[st.index].cuda_stream)
        handles.append(handle)
        w = arena_l2.stream_window(dev, handle)
        live = _live_window_bucket(st)
        assert w["base"] == live.data_ptr() and w["num_bytes"] == sizes[s]
        assert w["hit_ratio"] == pytest.approx(min(1.0, got[s] / sizes[s]), rel=1e-5)
    assert len(set(handles)) == len(handles)
    losses = _train(pipe, "cuda")
    torch.cuda.synchronize()
    assert [x.item() for x in losses] == [x.item() for x in reference]  # a hint, not a change
    del pipe
    gc.collect()
    assert arena_l2.device_limits(dev)["set_aside_bytes"] == 0
    assert all(arena_l2.stream_window(dev, h)["num_bytes"] == 0 for h in handles)


@pytest.mark.cuda
def test_cuda_window_follows_live_when_a_stashing_schedule_retires_it() -> None:
    _needs_persisting_l2()
    dev = torch.cuda.current_device()
    pipe = _pipe("cuda", schedule="pipedream", l2_persistence=True)
    _train(pipe, "cuda", steps=4)
    torch.cuda.synchronize()
    assert any(st.store.retirements for st in pipe.stages)  # live did move
    for s, st in enumerate(pipe.stages):
        w = arena_l2.stream_window(dev, int(pipe.parts.streams.streams[st.index].cuda_stream))
        assert w["base"] == _live_window_bucket(st).data_ptr(), f"stage {s}"


@pytest.mark.cuda
def test_cuda_one_stage_gets_a_stage_stream_for_its_window() -> None:
    _needs_persisting_l2()
    torch.manual_seed(0)
    pipe = Pipeline(
        [nn.Linear(64, 4).cuda()], schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), l2_persistence=True,
    )
    assert pipe.parts.streams.cuda and pipe.stats()["l2_persisting_bytes"][0] > 0
    pipe.step(torch.randn(4, 64, device="cuda"), torch.randn(4, 4, device="cuda"))
    torch.cuda.synchronize()
