"""Tied parameters on asynchronous schedules (engine/runtime/ties/carry.py): the tied weight is
the owner's (the lowest holder's), updated by the owner with the owner's delay, and every
holder of micro-batch n reads the value the owner's forward of n read. Checked against an
independent float64 reference (tests/ties_async_ref.py) for pb, pipedream and 2bw with every
mitigation, for a shared parameter, a shared module and a declared tie; also skip_update,
save/load, and under gloo (owner and head on different ranks) against the local run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_support import spawn, tied_stages, token_batch
from ties_async_ref import TiedReference
from ties_support import declaration, module_tied_stages, tied_factories
from torch import nn

import engine.optim as eo
from engine import Pipeline

M = 4
LR, MOM, WD = 0.2, 0.9, 0.01

CASES: dict[str, dict[str, Any]] = {
    "pipedream": dict(schedule="pipedream", opt={}),
    "2bw": dict(schedule="2bw", opt={}),
    "pb": dict(schedule="pb", opt={}),
    "pb-sc": dict(schedule="pb", opt=dict(spike_compensation=True), mitigation="sc"),
    "pipedream-sc": dict(schedule="pipedream", opt=dict(spike_compensation=True), mitigation="sc"),
    "pb-lwp": dict(schedule="pb", opt=dict(prediction="linear"), mitigation="lwp"),
    "pb-spectrain": dict(schedule="pb", opt=dict(prediction="linear"), mitigation="spectrain",
                         kw=dict(weight_prediction="spectrain")),
    "pb-t2": dict(schedule="pb", opt=dict(discrepancy_correction=True), mitigation="t2"),
    "pb-k2": dict(schedule="pb", opt={}, kw=dict(update_size=2)),
    "pipedream-dc": dict(schedule="pipedream", opt=dict(delay_compensation=0.5), mitigation="dc"),
    "pb-t2-dc": dict(schedule="pb", opt=dict(discrepancy_correction=True, delay_compensation=0.5),
                     mitigation="t2dc"),
}


def _opt(**extra: Any) -> Any:
    return lambda p: eo.SGD(p, lr=LR, momentum=MOM, weight_decay=WD, **extra)


def _pipe(stages: Any, case: dict[str, Any], S: int, checkpoint: str = "always", **kw: Any) -> Pipeline:
    return Pipeline(stages, schedule=case["schedule"], chunks=M, loss_fn=nn.functional.cross_entropy,
                    optimizer=_opt(**case["opt"]), checkpoint=checkpoint, **case.get("kw", {}), **kw)


def _reference(stages: list[nn.Module], case: dict[str, Any], pipe: Pipeline, head: str) -> TiedReference:
    S = len(stages)
    return TiedReference(stages, ((0, "embed.weight"), [(S - 1, head)]), case["schedule"], M,
                         pipe.update_size, pipe.delays, LR, MOM, WD, case.get("mitigation", ""),
                         dc=case["opt"].get("delay_compensation", 0.0))


def _train(pipe: Pipeline, ref: TiedReference | None, steps: int) -> None:
    for t in range(steps):
        x, y = token_batch(t)
        pipe.step(x, y)
        if ref is not None:
            for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
                ref.microbatch(xc, yc)
    pipe.flush()


def _compare(pipe: Pipeline, ref: TiedReference) -> None:
    for s, st in enumerate(pipe.stages):
        mine = dict(st.module.named_parameters())
        want = ref.weights(s)
        assert sorted(mine) == sorted(want), (s, sorted(mine), sorted(want))
        for name, w in want.items():
            torch.testing.assert_close(mine[name].double(), w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=s, name=name: f"stage {s} {name}: {m}")


@pytest.mark.parametrize("name,checkpoint", [(n, "always") for n in sorted(CASES)] + [
    (n, "never") for n in ("pipedream", "2bw", "pipedream-sc")])  # (F and B read one version)
def test_tied_async_equals_the_float64_reference(name: str, checkpoint: str) -> None:
    case, S = CASES[name], 3
    init = tied_stages(S)
    pipe = _pipe(tied_stages(S), case, S, checkpoint)
    assert pipe.ties and pipe.ties[0].carried
    assert [n for n, _ in pipe.stages[-1].module.named_parameters()] == ["body.0.weight", "body.0.bias"]
    ref = _reference(init, case, pipe, "weight")
    _train(pipe, ref, 4)
    _compare(pipe, ref)


@pytest.mark.parametrize("name", ["pipedream", "pb-lwp", "2bw"])
def test_shared_module_and_declared_tie_train_as_the_shared_parameter(name: str) -> None:
    """The same tie written three ways trains bit for bit alike: a shared nn.Parameter, a
    shared nn.Embedding module read by the head, and factories with a declared tie."""
    case, S = CASES[name], 3
    base = _pipe(tied_stages(S), case, S)
    mod = _pipe(module_tied_stages(S), case, S)
    dec = _pipe(tied_factories(S, head_seed=5), case, S, ties=declaration(S))
    for p in (base, mod, dec):
        _train(p, None, 4)
    for s in range(S):
        a = dict(base.stages[s].module.named_parameters())
        for other in (mod, dec):
            b = dict(other.stages[s].module.named_parameters())
            assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a), (name, s)


def test_tied_async_differs_from_the_untied_model() -> None:
    """The tie matters: the untied model (head with its own copy) trains otherwise."""
    case, S = CASES["pipedream"], 3
    tied = _pipe(tied_stages(S), case, S)
    untied_stages = tied_stages(S)
    untied_stages[-1].weight = nn.Parameter(untied_stages[-1].weight.detach().clone())
    untied = _pipe(untied_stages, case, S)
    _train(tied, None, 3)
    _train(untied, None, 3)
    assert not torch.equal(tied.stages[0].module.embed.weight, untied.stages[0].module.embed.weight)


def _poisonable(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; a target >= VOCAB (11) makes the micro-batch's loss NaN."""
    loss = nn.functional.cross_entropy(out, y % 11)
    return loss * torch.where((y >= 11).any(), float("nan"), 1.0)


@pytest.mark.parametrize("name", ["pb", "pipedream", "2bw", "pb-sc", "pb-lwp"])
def test_skip_update_skips_the_tied_group_with_the_head_contribution(name: str) -> None:
    """A NaN loss under on_nonfinite="skip_update": the owner's update whose group holds it
    is skipped (the head's NaN contribution to the tied weight included), as the reference
    skips that update at every stage."""
    case, S = CASES[name], 3
    init = tied_stages(S)
    pipe = Pipeline(tied_stages(S), schedule=case["schedule"], chunks=M, loss_fn=_poisonable,
                    optimizer=_opt(**case["opt"]), checkpoint="always", on_nonfinite="skip_update",
                    **case.get("kw", {}))
    ref = _reference(init, case, pipe, "weight")
    for t in range(4):
        x, y = token_batch(t)
        if t == 1:
            y = y.clone()
            y[len(y) // M] += 11  # micro-batch 1 of this step
        pipe.step(x, y)
        for i, (xc, yc) in enumerate(zip(x.chunk(M), y.chunk(M), strict=True)):
            ref.microbatch(xc, yc, poisoned=t == 1 and i == 1)
    pipe.flush()
    assert sum(pipe.stats()["skipped_updates"]) == S
    _compare(pipe, ref)


@pytest.mark.parametrize("name,checkpoint", [("pipedream", "never"), ("2bw", "never"), ("pb", "always"), ("pb-sc", "always")])
def test_tied_async_saves_and_loads_mid_run_without_a_flush(name: str, checkpoint: str) -> None:
    """state_dict() with micro-batches in flight (their carried values are leaves of the
    saved trees), loaded into a fresh pipeline: the rest of the run is bit for bit the
    uninterrupted one's."""
    case, S = CASES[name], 3
    pipe = _pipe(tied_stages(S), case, S, checkpoint)
    whole = _pipe(tied_stages(S), case, S, checkpoint)
    for t in range(3):
        x, y = token_batch(t)
        pipe.step(x, y)
        whole.step(x, y)
    assert not pipe.flushed
    state = copy.deepcopy(pipe.state_dict())
    resumed = _pipe(tied_stages(S), case, S, checkpoint)
    resumed.load_state_dict(state)
    for t in range(3, 6):
        x, y = token_batch(t)
        assert torch.equal(resumed.step(x, y), whole.step(x, y))
    resumed.flush()
    whole.flush()
    for a, b in zip(resumed.stages, whole.stages, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a.module.parameters(), b.module.parameters(), strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("S,only", [(2, None), (3, ["pipedream", "pb-lwp", "module-pb"])])
def test_gloo_tied_async_equals_local(S: int, only: list[str] | None) -> None:
    """Owner and head on different ranks (S = 3: the value passes a rank that holds no
    holder): weights, losses and evaluate() bit for bit as the local run."""
    results = spawn(S, [("ties_support.ties_async", dict(S=S, only=only))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name, r in res["ties_support.ties_async"].items():
            assert "error" not in r, (rank, name, r.get("error"))
            assert r["weights_equal"] and r["losses_equal"], (rank, name)
            assert r["carried"] == [name not in ("module-gpipe", "module-1f1b")], (rank, name)


@pytest.mark.parametrize("name", ["pipedream", "pb-lwp"])
def test_stage_streams_carry_the_tie_as_the_plain_run(name: str, monkeypatch) -> None:
    """The executor's CUDA-stream paths (tests/stream_twin.py: each stage's work inside its
    stream, batched backwards one stage at a time) hand the carried value over like any
    activation leaf: bit for bit the plain run, owner and head running on their streams."""
    from stream_twin import StreamTwin, twin_factory

    case, S = CASES[name], 3
    plain = _pipe(tied_stages(S), case, S, "never")
    box: list[StreamTwin] = []
    monkeypatch.setattr("engine.runtime.assemble.make_streams", twin_factory(box))
    twin_pipe = _pipe(tied_stages(S), case, S, "never")
    twin = box[0]
    for s in (0, S - 1):  # (training forwards; the first step's dry run is the caller's)
        twin_pipe.stages[s].module.register_forward_hook(
            lambda m, *a, s=s: twin.note(f"F{s}") if m.training else None)
    _train(plain, None, 4)
    _train(twin_pipe, None, 4)
    assert {w for what, w in twin.log if what == "F0"} == {0}
    assert {w for what, w in twin.log if what == f"F{S - 1}"} == {S - 1}
    for a, b in zip(plain.stages, twin_pipe.stages, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a.module.parameters(), b.module.parameters(), strict=True))


@pytest.mark.distributed
def test_gloo_tied_async_with_data_parallel_replicas() -> None:
    """2 stages x 2 replicas: equal to one replica with the twice larger batch."""
    results = spawn(4, [("ties_support.ties_replicas", dict(S=2, R=2))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name, r in res["ties_support.ties_replicas"].items():
            assert "error" not in r, (rank, name, r.get("error"))
            assert r["count"][0] == r["count"][1] and r["max_diff"] < 1e-5, (rank, name, r)
