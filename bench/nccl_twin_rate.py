"""Message rate of the NCCL twin (engine.testing.nccl_twin) against gloo, same processes.

Why: the engine's twin tests run every schedule at 2 and 4 ranks for ~10 steps of ~100 tiny
messages each; this says what one message costs. Two cases, each a paired-round ratio
(bench/harness.py) of the twin's time per call over gloo's, with the twin's absolute rate:

* ``ping-pong``: 2 ranks, 1 KiB; one call is one round trip (rank 0 sends, rank 1 sends back,
  unbatched ``dist.send``/``dist.recv``, so on the twin the pair's 2-rank communicator).
* ``ring``: 4 ranks (``--ring-ranks``), 1 KiB; one call is one ring step: every rank posts
  ``batch_isend_irecv([send to the right, receive from the left])`` and waits (4 messages).

Run: ``PYTHONPATH=. python bench/nccl_twin_rate.py [--rounds 11] [--out bench/results]`` (default
``--out``: out/bench).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import paired, summary_line, write_ratio_csv  # noqa: E402
from outputs import DEFAULT_OUT  # noqa: E402

KIB = 256  # float32 elements in 1 KiB


def _ping_pong(rank: int, x: torch.Tensor, group: Any) -> None:
    if rank == 0:
        dist.send(x, 1, group=group)
        dist.recv(x, 1, group=group)
    elif rank == 1:
        dist.recv(x, 0, group=group)
        dist.send(x, 0, group=group)


def _ring(rank: int, world: int, x: torch.Tensor, y: torch.Tensor, group: Any) -> None:
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world, group),
           dist.P2POp(dist.irecv, y, (rank - 1) % world, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _worker(rank: int, world: int, port: int, case: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    import engine.testing.nccl_twin  # noqa: F401

    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("nccl_twin", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    twin, gloo = dist.new_group(timeout=timeout), dist.new_group(backend="gloo", timeout=timeout)
    x, y = torch.ones(KIB), torch.zeros(KIB)
    if case == "ping-pong":
        calls = [lambda g=g: _ping_pong(rank, x, g) for g in (twin, gloo)]
    else:
        calls = [lambda g=g: _ring(rank, world, x, y, g) for g in (twin, gloo)]
    res = paired(calls[0], calls[1], rounds=args.rounds, warmup=2, inner=args.inner,
                 sync=lambda: dist.barrier(group=gloo))
    if rank == 0:
        row = res.row("nccl_twin_rate", f"{case} {world} ranks 1 KiB", "nccl_twin", "gloo",
                      extra={"twin_calls_per_s": 1.0 / (sorted(res.candidate_s)[len(res.candidate_s) // 2]),
                             "gloo_calls_per_s": 1.0 / (sorted(res.peer_s)[len(res.peer_s) // 2])})
        torch.save(row, out)
    dist.barrier(group=gloo)
    os._exit(0)


def _run(case: str, world: int, args: argparse.Namespace) -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = os.path.join(tempfile.mkdtemp(prefix="twin-rate-"), "row.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, case, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(args.timeout)
        if p.is_alive():
            p.kill()
    return torch.load(out, weights_only=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--inner", type=int, default=100, help="calls per timed block")
    ap.add_argument("--ring-ranks", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows = [_run("ping-pong", 2, args), _run("ring", args.ring_ranks, args)]
    for row in rows:
        print(summary_line(row))
        print(f"  twin {row.extra['twin_calls_per_s']:.0f} calls/s, gloo "
              f"{row.extra['gloo_calls_per_s']:.0f} calls/s")
    args.out.mkdir(parents=True, exist_ok=True)
    write_ratio_csv(rows, args.out / "nccl_twin_rate.csv")


if __name__ == "__main__":
    main()
