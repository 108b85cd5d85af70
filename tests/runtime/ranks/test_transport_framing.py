"""The message layout of transport/framing.py, without processes: an activation's header
inside its first leaf's message (what the sender builds is read back exactly by the
receiver's views, the leaf 64-byte aligned)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.ranks.transport import framing
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


def test_a_framed_receive_posts_no_buffer_of_its_own_for_leaf_0() -> None:
    """framed_buffers: leaf 0 lives in the framed buffer (the message gloo fills), the other
    leaves are posted as they are; what a tree's sender frames reads back leaf by leaf."""
    tree = (_leaf((3, 4), torch.float32), _leaf((5,), torch.int64), _leaf((2, 2), torch.bool))
    sig = Signature.of(tree)
    metas = sig.metas(False)
    bufs, msgs, head = framing.framed_buffers(metas, torch.device("cpu"))
    assert len(bufs) == len(msgs) == 3 and msgs[0] is head and msgs[1:] == bufs[1:]
    assert bufs[0].untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    for msg, sent in zip(msgs, [framing.frame(tree[0], 0), tree[1], tree[2]], strict=True):
        msg.copy_(sent.view(msg.dtype).reshape(msg.shape))  # what gloo does with each message
    assert framing.read_header(head) == 0
    assert all(torch.equal(b, t) and b.dtype == t.dtype for b, t in zip(bufs, tree, strict=True))
