"""The message layout of transport/framing.py, without processes: an activation's header
inside its first leaf's message (what the sender builds is read back exactly by the
receiver's views, the leaf 64-byte aligned)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.dist.transport import framing
from engine.runtime.stage.trees import LeafMeta, Signature

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


def _leaf(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(shape, generator=g) * 7
    return t > 0 if dtype == torch.bool else t.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3,), (127,), (2, 5, 3), (65537,)])
@pytest.mark.parametrize("n", [0, 5, -3])
def test_header_inside_the_first_leaf_reads_back_exactly(shape, dtype, n) -> None:
    leaf = _leaf(shape, dtype)
    raw = framing.frame(leaf, n)
    buf, got = framing.framed_buffer(LeafMeta(shape, dtype, True), torch.device("cpu"))
    assert raw.shape == buf.shape
    buf.copy_(raw)  # what gloo does with the message
    assert framing.read_header(buf) == n and torch.equal(got, leaf) and got.dtype == dtype
    assert (got.data_ptr() - buf.data_ptr()) % 64 == 0  # the leaf keeps its alignment
    assert not raw[8:framing.HEAD_BYTES].any()  # the padding carries no stale memory


def test_which_activations_carry_their_header_inline() -> None:
    small = Signature.of(torch.zeros(framing.INLINE_BYTES // 4))
    large = Signature.of(torch.zeros(framing.INLINE_BYTES // 4 + 1))
    assert framing.inline("gloo", small) and not framing.inline("gloo", large)
    assert not framing.inline("nccl", small)  # NCCL: the header always travels alone
