"""BatchNorm in a pipeline: recomputation never updates running statistics twice, and
``deferred_batch_norm=True`` makes them those of the whole mini-batch (torchgpipe's idea)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.runtime.setup.batch_norm import DeferredBatchNorm

M = 4


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU()),
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Tanh()),
        nn.Linear(8, 1),
    ]


def _data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]


def _pipe(schedule: str, checkpoint: str, deferred: bool) -> Pipeline:
    return Pipeline(
        _stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), checkpoint=checkpoint,
        deferred_batch_norm=deferred,
    )


def _running(modules) -> list[tuple[str, torch.Tensor]]:
    return [(k, v) for i, m in enumerate(modules) for k, v in m.state_dict().items()
            if "running" in k or "num_batches" in k]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_running_stats_equal_the_unpipelined_model_per_micro_batch(schedule: str, checkpoint: str) -> None:
    """Without deferral each micro-batch updates the statistics once -- also when the stage
    recomputes its forward inside the backward -- exactly as an unpipelined model fed the
    same micro-batches (and the same weights: lr 0 keeps them fixed here)."""
    pipe = Pipeline(
        _stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0), checkpoint=checkpoint,
    )
    ref = nn.Sequential(*_stages())
    for x, y in _data():
        pipe.step(x, y)
        for xc in x.chunk(M):
            ref(xc)
    ours = _running([st.module for st in pipe.stages])
    theirs = _running(list(ref))
    assert [k for k, _ in ours] == [k for k, _ in theirs]
    for (k, a), (_, b) in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pb"])
def test_deferred_batch_norm_tracks_the_whole_mini_batch(schedule: str, checkpoint: str) -> None:
    pipe = Pipeline(
        _stages(), schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.0), checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    assert sum(isinstance(m, DeferredBatchNorm) for st in pipe.stages for m in st.module.modules()) == 2
    # The reference: each micro-batch normalised with its own statistics (BatchNorm without
    # running statistics, same affine parameters), and for every BatchNorm a twin that sees
    # the mini-batch's inputs to that layer at once and tracks their statistics.
    ref = nn.Sequential(*_stages())
    twins, inputs = [], []
    for parent in ref.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm1d):
                twins.append(copy.deepcopy(child))
                plain = nn.BatchNorm1d(child.num_features, track_running_stats=False)
                plain.weight, plain.bias = child.weight, child.bias
                k = len(inputs)
                inputs.append([])
                plain.register_forward_pre_hook(lambda m, a, k=k: inputs[k].append(a[0].detach()))
                setattr(parent, name, plain)
    data = _data()
    for x, y in data:
        pipe.step(x, y)
        for xc in x.chunk(M):
            ref(xc)
        for twin, seen in zip(twins, inputs, strict=True):
            twin(torch.cat(seen))
            seen.clear()
    pipe.flush()
    ours = _running([st.module for st in pipe.stages])
    theirs = _running(twins)
    assert len(ours) == len(theirs) == 6
    for (k, a), (_, b) in zip(ours, theirs, strict=True):
        if "num_batches" in k:
            assert int(a) == int(b) == len(data), k
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_deferred_batch_norm_normalises_each_micro_batch_as_batch_norm_does() -> None:
    """Only the running statistics change: training outputs and gradients are those of
    nn.BatchNorm1d on the same micro-batch, and evaluation uses the running statistics."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    deferred = DeferredBatchNorm.from_batch_norm(copy.deepcopy(bn), chunks=2)
    x = torch.randn(6, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    a, b = bn(x), deferred(x2)
    torch.testing.assert_close(a, b)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert int(deferred.num_batches_tracked) == 0  # 1 of 2 micro-batches seen
    deferred(torch.randn(6, 5))
    assert int(deferred.num_batches_tracked) == 1
    deferred.eval()
    bn.eval()
    bn.load_state_dict(deferred.state_dict())
    z = torch.randn(3, 5)
    torch.testing.assert_close(deferred(z), bn(z))
