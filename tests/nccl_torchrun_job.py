"""What each rank of ``ENGINE_NCCL_TWIN=1 torchrun --standalone --nproc-per-node R
tests/nccl_torchrun_job.py OUT`` runs (tests/runtime/ranks/test_transport_nccl_torchrun.py): the engine
initialises the process group itself (``Pipeline(transport="nccl")``, no
``init_process_group`` here), and every schedule family trains against the local run of the
same configuration, bit for bit. Each rank writes ``OUT/rank{r}.json``: per family, whether
its losses and the weights of the stages it holds equal the local run's."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distributed_support import _sgd, batch, configs, stage_factories  # noqa: E402

from engine import Pipeline  # noqa: E402

STEPS = 4
#: families whose stages are placed on the R ranks by a program: (schedule, stages per rank,
#: extra keywords)
PLACED = {
    "interleaved": (2, dict(virtual_stages=2)),
    "looped_bfs": (2, dict(virtual_stages=2)),
    "zbv": (2, {}),
    "dualpipev": (2, {}),
    "vhalf": (2, {}),
    "vmin": (2, {}),
}


def _compare(pipe: Any, ref: Any, M: int) -> dict[str, Any]:
    same = True
    for t in range(STEPS):
        x, y = batch(t, 2 * M)
        same &= torch.equal(pipe.step(x, y), ref.step(x, y))
    pipe.flush()
    ref.flush()
    weights = all(
        torch.equal(a, b)
        for st in pipe.stages
        for a, b in zip(st.module.parameters(), ref.stages[st.index].module.parameters(), strict=True)
    )
    return {"losses_equal": bool(same), "weights_equal": weights,
            "stages": [st.index for st in pipe.stages]}


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    R = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    got: dict[str, Any] = {}
    for name, kw in configs(R).items():
        try:
            pipe = Pipeline(stage_factories(R), loss_fn=nn.functional.mse_loss, transport="nccl",
                            timeout=60, **kw)
            ref = Pipeline([f() for f in stage_factories(R)], loss_fn=nn.functional.mse_loss, **kw)
            got[name] = _compare(pipe, ref, kw["chunks"])
        except Exception:
            got[name] = {"error": traceback.format_exc()}
    for name, (v, extra) in PLACED.items():
        M = 2 * R
        kw = dict(schedule=name, chunks=M, optimizer=_sgd(), loss_fn=nn.functional.mse_loss, **extra)
        try:
            pipe = Pipeline(stage_factories(R * v), transport="nccl", timeout=60, **kw)
            ref = Pipeline([f() for f in stage_factories(R * v)], **kw)
            got[name] = _compare(pipe, ref, M)
        except Exception:
            got[name] = {"error": traceback.format_exc()}
    import torch.distributed as dist

    got["backend"] = dist.get_backend()
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
