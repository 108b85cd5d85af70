"""Resume without a flush: an unflushed asynchronous pipeline's state dict holds its
micro-batches in flight, and save at step k + load into a fresh pipeline + continue equals the
never-interrupted, never-flushed run bit for bit (engine.runtime.inflight)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.errors import CheckpointError, NotFlushedError
from engine.serialization import load, save

optim = pytest.importorskip("engine.optim")

#: (schedule, chunks, update_size, optimizer, checkpoint)
CASES = {
    "pipedream-k1": ("pipedream", 3, 1, "sgd", "never"),
    "pipedream-k2": ("pipedream", 3, 2, "adam", "never"),
    "pipedream-k3-recompute": ("pipedream", 3, 3, "sgd", "always"),
    "2bw": ("2bw", 3, None, "adam", "never"),
    "2bw-recompute": ("2bw", 4, None, "sgd", "always"),
}


def _pipe(case: str, seed: int = 0, schedule: str | None = None, **kw) -> Pipeline:
    name, chunks, k, opt, ckpt = CASES[case]
    torch.manual_seed(seed)
    stages = [
        nn.Sequential(nn.Linear(4, 6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 1)),
    ]

    def make(p):
        if opt == "adam":
            return optim.Adam(p, lr=1e-2, **kw)
        return optim.SGD(p, lr=0.05, momentum=0.9, **kw)

    extra = {} if k is None else {"update_size": k}
    return Pipeline(
        stages, chunks=chunks, loss_fn=nn.functional.mse_loss, optimizer=make,
        schedule=schedule or name, checkpoint=ckpt, **extra,
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
    chunks = CASES[case][1]
    data = _data(7, chunks)
    k = 3
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
    data = _data(6, 3)
    a, b = _pipe("pipedream-k2"), _pipe("pipedream-k2")
    la, lb = [], []
    for n, (x, y) in enumerate(data):
        la.append(a.step(x, y))
        lb.append(b.step(x, y))
        if n in (1, 3):
            b.state_dict()
    _assert_same(a, b, la, lb)


def test_in_memory_state_dict_roundtrip_at_every_step() -> None:
    """Save after every step of one run (saving changes nothing), each into a fresh pipeline
    that continues to the end: all equal the uninterrupted run."""
    data = _data(5, 3)
    ref = _pipe("2bw")
    la = [ref.step(x, y) for x, y in data]
    src = _pipe("2bw")
    for n, (x, y) in enumerate(data[:-1], start=1):
        src.step(x, y)
        b = _pipe("2bw", seed=3)
        b.load_state_dict(src.state_dict())
        lb = [b.step(x2, y2) for x2, y2 in data[n:]]
        _assert_same(ref, b, la[n:], lb)


def test_unrebuildable_policies_refuse_clearly() -> None:
    torch.manual_seed(0)
    pipe = Pipeline(
        [nn.Linear(4, 4), nn.Linear(4, 1)], chunks=2, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: optim.SGD(p, lr=0.1), schedule="pb",
    )
    x, y = _data(1, 2)[0]
    pipe.step(x, y)
    with pytest.raises(NotFlushedError, match="'pb'.*flush"):
        pipe.state_dict()
    pipe.flush()
    pipe.state_dict()  # flushed: fine


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
    for x, y in zip(before, _state(same), strict=True):
        assert torch.equal(x, y)
    assert same.flushed
