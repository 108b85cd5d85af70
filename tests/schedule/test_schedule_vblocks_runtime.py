"""V-Min and V-Half run: ``Pipeline(stages, schedule="vmin" | "vhalf")`` trains *bit for bit*
like the local gpipe run of the same stages (torch.equal on every loss and weight), in one
process (every recomputation mode, several mini-batches) and across processes (4 by default,
ENGINE_TEST_RANKS=2 for the quick run), each rank holding its two stages of the V.

Why bitwise and not within 1e-6: both schedules apply each stage's M gradients in one update,
and every stage runs its backwards (B, then W) in micro-batch order, so the weight gradients
accumulate in gpipe's order; splitting B from W changes when the weight gradient is computed,
not how.

The multi-process test takes the transport as a parameter (``TRANSPORTS``): a transport with
the same semantics joins by adding its name there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_support import RANKS, _sgd, batch, spawn, stage_factories
from test_runtime_sync import _model
from torch import nn

from engine import Pipeline

FAMILIES = ("vmin", "vhalf")
#: the multi-process transports the V-Min/V-Half equality runs under
TRANSPORTS = ("gloo",)


def _opt(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("S,M,checkpoint", [(4, 4, "never"), (6, 5, "except_last"),
                                            (8, 16, "always"), (2, 3, "never")])
def test_local_run_equals_gpipe_bit_for_bit(name: str, S: int, M: int, checkpoint: str) -> None:
    pipes = [Pipeline(_model(S), schedule=s, chunks=M, loss_fn=nn.functional.mse_loss,
                      optimizer=_opt, checkpoint=checkpoint) for s in (name, "gpipe")]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(2 * M, 4, generator=g), torch.randn(2 * M, 2, generator=g)
        a, b = (p.step(x, y) for p in pipes)
        assert torch.equal(a, b)
    for p, q in zip(*([t for st in pipe.stages for t in st.module.parameters()] for pipe in pipes),
                    strict=True):
        assert torch.equal(p, q)
    pipe = pipes[0]
    assert pipe.spec.synchronous and pipe.spec.program.ranks == S // 2
    assert pipe.stats()["delays"] == [0] * S
    assert max(pipe.stats()["activation_peak"]) >= 1


def phase_vblocks(rank: int, R: int, transport: str) -> dict[str, Any]:
    """Each family on R processes (rank r holds stages r and 2R-1-r) against the local gpipe
    run of the same 2R stages, 3 steps of M = 2R micro-batches: losses and this rank's
    weights compared with torch.equal."""
    V, M = 2 * R, 2 * R
    out: dict[str, Any] = {}
    for name in FAMILIES:
        kw = dict(chunks=M, optimizer=_sgd(), loss_fn=nn.functional.mse_loss)
        try:
            pipe = Pipeline(stage_factories(V), schedule=name, transport=transport, timeout=30, **kw)
            ref = Pipeline([f() for f in stage_factories(V)], schedule="gpipe", **kw)
            losses = True
            for t in range(3):
                x, y = batch(t, 2 * M)
                losses &= torch.equal(pipe.step(x, y), ref.step(x, y))
            weights = all(
                torch.equal(a, b)
                for st in pipe.stages
                for a, b in zip(st.module.parameters(), ref.stages[st.index].module.parameters(),
                                strict=True)
            )
            out[name] = {"stages": [st.index for st in pipe.stages], "losses_equal": losses,
                         "weights_equal": weights, "updates": [st.updates for st in pipe.stages]}
        except Exception as exc:  # reported by the test, with the rank
            import traceback

            out[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_multi_process_run_equals_gpipe_bit_for_bit(transport: str) -> None:
    R = RANKS
    phase = "test_schedule_vblocks_runtime:vblocks"
    results = spawn(R, [(phase, dict(R=R, transport=transport))], timeout=300)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        for name in FAMILIES:
            r = res[phase][name]
            assert "error" not in r, f"rank {rank} ({name}): {r.get('error')}"
            assert r["stages"] == sorted((rank, 2 * R - 1 - rank)), (name, r)
            assert r["losses_equal"] and r["weights_equal"], (name, rank, r)
            assert r["updates"] == [3, 3], (name, r)
