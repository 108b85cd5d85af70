"""Activation offload (engine/runtime/stage/offload.py): saved activations wait in host memory, the
weights a forward saved stay where they are, and every schedule's results are bit for bit
those without offload, with every recomputation mode and autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import Pipeline
from engine.errors import PipelineConfigError

D, M = 6, 4


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D)) for _ in range(2)] + [
        nn.Linear(D, 2)]


def _run(offload: bool, **kw: Any) -> tuple[Pipeline, list[torch.Tensor]]:
    pipe = Pipeline(_stages(), chunks=M, loss_fn=nn.functional.mse_loss,
                    offload_activations=offload, **kw)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        losses.append(pipe.step(torch.randn(2 * M, D, generator=g), torch.randn(2 * M, 2, generator=g)))
    pipe.flush()
    return pipe, losses


def _sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(
    "kw",
    [
        dict(schedule="gpipe", checkpoint="never", optimizer=_sgd),
        dict(schedule="1f1b", checkpoint="except_last", optimizer=_sgd),
        dict(schedule="zbh1", checkpoint="never", optimizer=_sgd),
        dict(schedule="pb", checkpoint="never", optimizer=_sgd),  # B reads later live weights
        dict(schedule="pipedream", checkpoint="never", optimizer=_sgd),  # B reads a stashed version
        dict(schedule="2bw", checkpoint="never", optimizer=_sgd),
        dict(schedule="gpipe", checkpoint="never", optimizer=_sgd, autocast=torch.bfloat16),
        dict(schedule="pb", checkpoint="always",
             optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, prediction="linear")),
        # small stages: the backward reads the live weights by a copy into the forward's
        # transient (no saved-tensor hooks), so offload composes with LWP without recomputing
        dict(schedule="pb", checkpoint="never",
             optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, prediction="linear")),
    ],
    ids=["gpipe", "1f1b", "zbh1", "pb", "pipedream", "2bw", "gpipe-bf16", "pb-lwp-ckpt", "pb-lwp"],
)
def test_offload_is_bitwise_equal_to_no_offload(kw: dict[str, Any]) -> None:
    a, la = _run(True, **kw)
    b, lb = _run(False, **kw)
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    for sa, sb in zip(a.stages, b.stages, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(sa.module.parameters(), sb.module.parameters(),
                                                     strict=True))
    act = a.stats()["activation_bytes"]
    recomputing = [st.recompute for st in a.stages]
    for st, r, got in zip(a.stages, recomputing, act, strict=True):
        if r:  # a recomputed stage saves nothing but its input, which the stash holds
            assert got["host_peak"] == 0
        else:  # GELU and LayerNorm save activations: they went to host memory
            assert got["host_peak"] > 0, st.index
        assert got["host_now"] == 0  # flushed: every backward ran, every copy freed
    assert b.stats()["activation_bytes"] == [None] * 3


def test_saved_weights_stay_and_activations_move() -> None:
    """The forward's saved weight views are not copied (their values are part of the
    schedule's semantics); the activations are."""
    pipe = Pipeline(_stages()[:1] + [nn.Linear(D, 2)], schedule="gpipe", chunks=1,
                    loss_fn=nn.functional.mse_loss, optimizer=_sgd, checkpoint="never",
                    offload_activations=True)
    off = pipe.stages[0].offload
    packed: list[Any] = []
    real = off._pack
    off._pack = lambda t: packed.append(real(t)) or packed[-1]  # type: ignore[method-assign]
    pipe.step(torch.randn(3, D), torch.randn(3, 2))
    kept = [t for dev, t in packed if dev is None]
    moved = [t for dev, t in packed if dev is not None]
    weight = pipe.stages[0].module[0].weight
    assert any(t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for t in kept)
    assert moved and all(t.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
                         for t in moved)


def test_offload_with_remapped_saved_weights_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="offload_activations"):
        Pipeline(_stages(), schedule="pb", chunks=M, loss_fn=nn.functional.mse_loss,
                 optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, discrepancy_correction=True),
                 checkpoint="never", offload_activations=True)


def test_bad_offload_option() -> None:
    with pytest.raises(PipelineConfigError, match="offload_activations"):
        Pipeline(_stages(), schedule="gpipe", chunks=M, loss_fn=nn.functional.mse_loss,
                 optimizer=_sgd, offload_activations="yes")
