"""The gloo transport's bookkeeping: receives posted ahead are all consumed within the call
that posted them, and the works a rank holds (sends, loss messages) stay bounded over many
steps. gloo's ``Work.is_completed()`` stays False until ``wait()``, so a list pruned by polling
it grows forever; these counts would catch that.

Cost: one 3-process spawn, ~10 s on 2 cores. (Bit-exact equality with the local run, which
the posted-ahead receives must not change, is tests/runtime/ranks/test_distributed_gloo.py's.)
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_support import batch, configs, free_port, run_ranks, stage_factories
from torch import nn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

S = 3
STEPS = 6


def _counts(pipe: Any) -> dict[str, int]:
    tp = pipe.parts.rank.transport
    return {
        "posted": len(tp._posted),
        "sends": len(tp._sends),
        "act_sends": sum(1 for ch, _ in tp._sends if ch == "act"),
        "loss_sends": len(pipe.parts.rank._loss_sends),
    }


def _run(rank: int) -> dict[str, Any]:
    from engine import Pipeline

    out: dict[str, Any] = {}
    for name in ("gpipe", "1f1b-adam", "pb"):
        pipe = Pipeline(
            stage_factories(S),
            loss_fn=nn.functional.mse_loss,
            transport="gloo",
            timeout=30,
            **configs(S)[name],
        )
        per_step = []
        for t in range(STEPS):
            x, y = batch(t)
            pipe.step(x, y)
            per_step.append(_counts(pipe))
        pipe.flush()
        out[name] = {"steps": per_step, "flushed": _counts(pipe), "M": pipe.chunks}
    return out


def _worker(rank: int, outdir: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(S)
    )
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        result: dict[str, Any] = _run(rank)
        dist.barrier()
    except Exception:
        result = {"fatal": traceback.format_exc()}
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(S, _worker, (free_port(),), 180, prefix="engine-p2p-")


def test_no_rank_failed(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert res and "fatal" not in res, f"rank {r}: {res.get('fatal', 'no result')}"


@pytest.mark.parametrize("name", ["gpipe", "1f1b-adam"])
def test_sync_step_leaves_nothing_posted_or_unsent(
    results: list[dict[str, Any]], name: str
) -> None:
    for r, res in enumerate(results):
        for t, c in enumerate(res[name]["steps"]):
            assert c["posted"] == 0, (r, t, c)  # every receive posted ahead was consumed
            assert c["sends"] == 0, (r, t, c)  # waited for at the end of the step
            assert c["loss_sends"] <= S - 1, (r, t, c)  # only this step's, not every step's


def test_async_works_stay_bounded(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        steps = res["pb"]["steps"]
        M = res["pb"]["M"]
        for t, c in enumerate(steps):
            assert c["posted"] == 0, (r, t, c)
            assert c["loss_sends"] <= S - 1, (r, t, c)
            # an activation's send is let go when its gradient comes back: at most the
            # micro-batches in flight, not every one sent since the last flush
            assert c["act_sends"] <= 2 * M, (r, t, c)
        flushed = res["pb"]["flushed"]
        assert flushed["posted"] == 0 and flushed["sends"] == 0, (r, flushed)
