"""Host time of a captured pb step with the launches stubbed (issue 23's third goal), on CPU.

What a replayed step costs the host, apart from the GPU: the staging copies (one ``copy_`` per
tensor leaf and micro-batch slot), the ring's rotation replay, the window's replay call, and
the host shift applied after it (engine/runtime/capture/asynchronous.py). A stub backend stands in
for CUDA graphs: its capture runs the window once (so the pipeline's state is real), its
replays do nothing. Measured against the eager step of the same pipeline on the same machine
(alternating paired rounds, bench/harness.py), on pb batch 1, S=8, M=8, the issue's model
(``engine.demo.models.residual_mlp(64, 10, layers=16, width=64)``), SGD + SC + LWP, skip_update,
engine.optim's reference path on both sides (``PE_CPU_LOOP=0``: the CPU loop reads found_inf on
the host, which a captured window may not).

    python bench/capture_host_time.py            # ~1 min on a 2-core CPU

Prints the ratio row and the replay path's host time per step and per micro-batch. The numbers
say nothing about a GPU's kernels: a stubbed replay computes nothing (losses are stale).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import paired, summary_line  # noqa: E402
from overhead import M, S, digits_data, stepper  # noqa: E402
from pipeline_pb_capture_gpu import pipeline  # noqa: E402

from engine.runtime.capture.synchronous import use_backend  # noqa: E402


class StubBackend:
    """Capture runs the window (its device work happens once, on the CPU); replay does nothing."""

    runs_at_capture = True

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, window: Callable[[], None]) -> Callable[[], None]:
        window()

        def replay() -> None:
            self.replays += 1

        return replay


def main(argv: Sequence[str] | None = None) -> int:
    # both sides on engine.optim's reference path: the CPU loop reads found_inf on the host,
    # which a window may not (the fused CUDA kernels read it on the device)
    os.environ["PE_CPU_LOOP"] = "0"
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    data = digits_data()
    stub = StubBackend()
    with use_backend(stub):
        captured = pipeline(64, "program", cpu)
    eager = pipeline(64, False, cpu)
    go_c, go_e = stepper(captured.step, data), stepper(eager.step, data)
    for _ in range(16):
        go_c()
        go_e()
    cap = captured.stats()["capture"]
    if cap["captures"] != 1 or cap["replays"] < 1:
        raise AssertionError(f"capture_host_time: not replaying: {cap}")
    res = paired(go_c, go_e, rounds=15, warmup=3, min_time=0.2, device=cpu)
    row = res.row("capture_host_time", f"pb batch1 S={S} M={M} width 64, CPU, launches stubbed",
                  "captured step (stubbed replay)", "eager step", note="host time only")
    print(summary_line(row))
    import statistics

    per_step, eager_step = statistics.median(res.candidate_s), statistics.median(res.peer_s)
    print(f"replay path: {per_step * 1e6:.0f} us per step, {per_step * 1e6 / M:.1f} us per "
          f"micro-batch (eager step: {eager_step * 1e3:.1f} ms)")
    print(f"stats: {captured.stats()['capture']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
