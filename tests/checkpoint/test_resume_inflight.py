"""Resume without a flush: an unflushed asynchronous pipeline's state dict holds its
micro-batches in flight, and save at step k + load into a fresh pipeline + continue equals the
never-interrupted, never-flushed run bit for bit (engine.runtime.state.inflight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.optim as optim
from engine import Pipeline
from engine.errors import CheckpointError, NotFlushedError
from engine.serialization import load, save


#: name -> Pipeline keywords (chunks, optimizer, opt: optimizer options, t1: PipeMareLR)
CASES: dict[str, dict] = {
    "pipedream-k1": dict(schedule="pipedream", chunks=3, update_size=1),
    "pipedream-k2": dict(schedule="pipedream", chunks=3, update_size=2, optimizer="adam"),
    "pipedream-k3-recompute": dict(schedule="pipedream", chunks=3, update_size=3, checkpoint="always"),
    "2bw": dict(schedule="2bw", chunks=3, optimizer="adam"),
    "2bw-recompute": dict(schedule="2bw", chunks=4, checkpoint="always"),
    "pb": dict(schedule="pb", chunks=3, checkpoint="always"),
    "pb-1f1b-k2": dict(schedule="pb", chunks=3, order="1f1b", update_size=2, checkpoint="always"),
    "pb-lwp": dict(schedule="pb", chunks=3, checkpoint="always", opt=dict(prediction="linear")),
    "pb-spectrain": dict(
        schedule="pb", chunks=3, checkpoint="always", weight_prediction="spectrain",
        opt=dict(prediction="linear"),
    ),
    "pb-spectrain-reuse-k2": dict(
        schedule="pb", chunks=3, update_size=2, weight_prediction="spectrain_reuse",
        opt=dict(prediction="linear"),
    ),
    "pb-t2": dict(schedule="pb", chunks=3, checkpoint="always", opt=dict(discrepancy_correction=True)),
    # recomputation on every stage but the last (the last has nothing in flight)
    "pb-except-last": dict(schedule="pb", chunks=3, checkpoint="except_last"),
    "pb-lwp-except-last": dict(
        schedule="pb", chunks=3, checkpoint="except_last", opt=dict(prediction="linear")
    ),
    "pb-t2-except-last": dict(
        schedule="pb", chunks=3, checkpoint="except_last", opt=dict(discrepancy_correction=True)
    ),
    "pb-sc-t1": dict(
        schedule="pb", chunks=2, checkpoint="always", opt=dict(spike_compensation=True), t1=True
    ),
}


def _pipe(case: str, seed: int = 0, **over) -> Pipeline:
    cfg = {**CASES[case], **over}
    opt_kw = cfg.pop("opt", {})
    adam = cfg.pop("optimizer", "sgd") == "adam"
    t1 = cfg.pop("t1", False)
    torch.manual_seed(seed)
    stages = [
        nn.Sequential(nn.Linear(4, 6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 1)),
    ]

    def make(p):
        if adam:
            return optim.Adam(p, lr=1e-2, **opt_kw)
        return optim.SGD(p, lr=0.05, momentum=0.9, **opt_kw)

    return Pipeline(
        stages, loss_fn=nn.functional.mse_loss, optimizer=make,
        lr_scheduler=(lambda o: optim.PipeMareLR(o, 5)) if t1 else None, **cfg,
    )


def _data(n: int, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2 * chunks, 4, generator=g), torch.randn(2 * chunks, 1, generator=g)) for _ in range(n)]


def _state(pipe: Pipeline) -> list[torch.Tensor]:
    out = []
    for st in pipe.stages:
        out += [t.detach().clone() for t in st.module.state_dict().values()]
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _assert_same(a: Pipeline, b: Pipeline, la: list, lb: list) -> None:
    for x, y in zip(la, lb, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    sa, sb = _state(a), _state(b)
    assert len(sa) == len(sb) and sa
    for x, y in zip(sa, sb, strict=True):
        assert torch.equal(x, y)
    assert a.steps == b.steps


@pytest.mark.parametrize("case", list(CASES))
def test_resume_unflushed_is_bitwise(case: str, tmp_path) -> None:
    chunks = CASES[case]["chunks"]
    data = _data(5, chunks)
    k = 2
    a = _pipe(case)
    for x, y in data[:k]:
        a.step(x, y)
    assert "in_flight" in a.state_dict()  # micro-batches are in flight
    path = tmp_path / "c.safetensors"
    save(a, path)
    la = [a.step(x, y) for x, y in data[k:]]
    la.append(a.flush())

    b = _pipe(case, seed=99)  # a different init: everything comes from the file
    load(b, path)
    lb = [b.step(x, y) for x, y in data[k:]]
    lb.append(b.flush())
    _assert_same(a, b, la, lb)


def test_saving_does_not_change_the_run() -> None:
    """Saving changes neither the run nor, as the run goes on, the state dict held in memory."""
    data = _data(5, 3)
    a, b = _pipe("pipedream-k2"), _pipe("pipedream-k2")
    la, lb = [], []
    for n, (x, y) in enumerate(data):
        la.append(a.step(x, y))
        lb.append(b.step(x, y))
        if n == 1:
            held = b.state_dict()
    _assert_same(a, b, la, lb)
    c = _pipe("pipedream-k2", seed=4)
    c.load_state_dict(held)
    _assert_same(a, c, la[2:], [c.step(x, y) for x, y in data[2:]])


def test_in_memory_state_dict_roundtrip_at_every_step() -> None:
    """Save after every step of one run (saving changes nothing), each into a fresh pipeline
    that continues to the end: all equal the uninterrupted run."""
    data = _data(4, 3)
    ref = _pipe("2bw")
    la = [ref.step(x, y) for x, y in data]
    src = _pipe("2bw")
    for n, (x, y) in enumerate(data[:-1], start=1):
        src.step(x, y)
        b = _pipe("2bw", seed=3)
        b.load_state_dict(src.state_dict())
        lb = [b.step(x2, y2) for x2, y2 in data[n:]]
        _assert_same(ref, b, la[n:], lb)


def test_overwritten_live_weights_refuse_clearly() -> None:
    """pb without recomputation: a forward in flight read weights that later updates
    overwrote, so it cannot be re-run; state_dict() says so and changes nothing."""
    data = _data(4, 3)
    a, ref = _pipe("pb", checkpoint="never"), _pipe("pb", checkpoint="never")
    la = [a.step(x, y) for x, y in data[:2]]
    with pytest.raises(NotFlushedError, match=r"stage 0's forward of micro-batch \d+ read weight version"):
        a.state_dict()
    la += [a.step(x, y) for x, y in data[2:]]
    lr = [ref.step(x, y) for x, y in data]
    _assert_same(a, ref, la, lr)


def test_loading_into_another_configuration_changes_nothing() -> None:
    data = _data(3, 3)
    a = _pipe("pipedream-k1")
    for x, y in data:
        a.step(x, y)
    state = a.state_dict()
    other = _pipe("pipedream-k2")
    before = _state(other)
    with pytest.raises(CheckpointError, match="update_size"):
        other.load_state_dict(state)
    state["in_flight"]["stages"][1]["grads"] = [torch.zeros(3)]
    same = _pipe("pipedream-k1", seed=5)
    before = _state(same)
    with pytest.raises(CheckpointError, match="stage 1: pending gradients"):
        same.load_state_dict(state)
    state["in_flight"]["wire"] = {"received": [], "outbox": []}  # as a gloo rank writes it
    with pytest.raises(CheckpointError, match="another transport"):
        same.load_state_dict(state)
    for x, y in zip(before, _state(same), strict=True):
        assert torch.equal(x, y)
    assert same.flushed


class _TreeIn(nn.Module):
    """Stage 0 of a tree-valued pipeline: a dict of inputs in, a dict with a float leaf, a
    mask that needs no gradient and a constant out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> dict:
        return {"h": torch.tanh(self.lin(x)), "keep": keep, "scale": 0.5}


class _TreeMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor, keep: torch.Tensor, scale: float) -> tuple:
        return torch.tanh(self.lin(h)) * keep.unsqueeze(1) * scale, keep


class _TreeOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.lin(h) * keep.unsqueeze(1)


TREE_CASES = ["pipedream-k2", "2bw", "pb-1f1b-k2", "pb-spectrain-reuse-k2"]


@pytest.mark.parametrize("case", TREE_CASES)
def test_resume_unflushed_tree_valued_stages_is_bitwise(case: str, tmp_path) -> None:
    """Inputs, activations, stashed stage inputs and targets that are trees (a dict in, a dict
    with a mask and a constant between stages, a tuple after) go through the file too."""
    cfg = {k: v for k, v in CASES[case].items() if k not in ("opt", "t1")}
    opt_kw = CASES[case].get("opt", {})
    adam = cfg.pop("optimizer", "sgd") == "adam"
    chunks = cfg["chunks"]

    def make(seed: int) -> Pipeline:
        torch.manual_seed(seed)
        stages = [_TreeIn(), _TreeMid(), _TreeOut()]
        opt = (lambda p: optim.Adam(p, lr=1e-2, **opt_kw)) if adam else (
            lambda p: optim.SGD(p, lr=0.05, momentum=0.9, **opt_kw))
        return Pipeline(stages, loss_fn=lambda o, t: nn.functional.mse_loss(o, t["y"]),
                        optimizer=opt, **cfg)

    g = torch.Generator().manual_seed(3)
    data = [
        ({"x": torch.randn(2 * chunks, 4, generator=g),
          "keep": (torch.rand(2 * chunks, generator=g) > 0.3).float()},
         {"y": torch.randn(2 * chunks, 1, generator=g)})
        for _ in range(5)
    ]
    k = 2
    a = make(0)
    for x, y in data[:k]:
        a.step(x, y)
    assert "in_flight" in a.state_dict()
    path = tmp_path / "c.safetensors"
    save(a, path)
    la = [a.step(x, y) for x, y in data[k:]] + [a.flush()]
    b = make(99)
    load(b, path)
    lb = [b.step(x, y) for x, y in data[k:]] + [b.flush()]
    _assert_same(a, b, la, lb)


def test_gradient_flags_that_do_not_fit_their_tensors_are_refused_before_loading() -> None:
    """A hand-edited in-flight state whose requires_grad flags do not fit the saved tensors
    is a CheckpointError naming the micro-batch, and the pipeline is left as it was."""
    data = _data(2, 3)
    a = _pipe("pipedream-k1")
    for x, y in data:
        a.step(x, y)
    for edit, needle in [
        (lambda st: st["stages"][1]["stash"][0].update(x_grad=[True, False]), "input has 2 gradient flags for 1 tensors"),
        (lambda st: st["grads"][0].update(grad=[]), "the grad for stage 0 of micro-batch 4 has 0 gradient flags"),
    ]:
        state = a.state_dict()
        edit(state["in_flight"])
        b = _pipe("pipedream-k1", seed=5)
        before = _state(b)
        with pytest.raises(CheckpointError, match=needle):
            b.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(before, _state(b), strict=True)) and b.flushed
