"""Every engine._C binding that can throw raises a Python exception, never crashes.

Why at the raw binding level: engine.arena validates most input before it reaches C++, so
the C++ checks behind it are rarely exercised, and on the H100 machine the first one that
was (`Arena::free_slot` refusing a double buffer's slot) killed the process instead of
raising (issue 22). These tests call each binding directly with input it must refuse and
expect the Python exception; a table check makes every binding of the module either
appear here with its trigger or be listed as one that cannot be made to throw on purpose,
so a new binding cannot skip the check. One test repeats the original crash in a child
process, so that a crash there fails a test instead of killing the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import _C

ROOT = Path(__file__).resolve().parents[2]
CUDA_BUILD = bool(_C.build_info()["cuda"])
MISSING = 99  # a slot id / bucket index that does not exist


def cpu_arena(requires_grad: bool = True) -> _C.Arena:
    a = _C.Arena(256)
    a.add_bucket([torch.ones(5), torch.ones(2, 3)], 0, requires_grad)
    return a


def with_slot(pin: int | None = None) -> tuple[_C.Arena, int]:
    a = cpu_arena()
    return a, int(a.snapshot(0, pin))


def held_slot() -> tuple[_C.Arena, int]:
    a, s = with_slot()
    a.hold(s)
    return a, s


def _snapshot_then_add() -> None:
    a, _ = with_slot()
    a.add_bucket([torch.ones(3)], 1, True)


# name -> (call that must raise, exception type, message pattern)
TRIGGERS: dict[str, tuple[Callable[[], object], type[BaseException], str]] = {
    "aligned_zeros": (lambda: _C.aligned_zeros(4, torch.float32, torch.device("cpu"), 3),
                      RuntimeError, "power of two"),
    "sgd_step_cpu": (lambda: _C.sgd_step_cpu(torch.ones(4, dtype=torch.float64), torch.ones(4),
                                             None, None, None, 0.1, 0.0, 0.0, 0.0, False, False,
                                             False, False, 0.0, 0.0, 0.0, 0.0, None),
                     RuntimeError, "param must be a contiguous float32"),
    "reset_persisting_l2": (lambda: _C.reset_persisting_l2(-1), RuntimeError,
                            "without CUDA" if not CUDA_BUILD else "cuda"),
    "clear_stream_window": (lambda: _C.clear_stream_window(-1, 0), RuntimeError,
                            "without CUDA" if not CUDA_BUILD else "cuda"),
    "stream_window": (lambda: _C.stream_window(-1, 0), RuntimeError,
                      "without CUDA" if not CUDA_BUILD else "cuda"),
    "Arena.__init__": (lambda: _C.Arena(3), RuntimeError, "power of two"),
    "Arena.add_bucket": (lambda: cpu_arena().add_bucket([], 0, True), RuntimeError,
                         "at least one tensor"),
    "Arena.bucket_param": (lambda: cpu_arena().bucket_param(MISSING), RuntimeError, "out of range"),
    "Arena.bucket_grad": (lambda: cpu_arena().bucket_grad(MISSING), RuntimeError, "out of range"),
    "Arena.bucket_offsets": (lambda: cpu_arena().bucket_offsets(MISSING), RuntimeError,
                             "out of range"),
    "Arena.bucket_numels": (lambda: cpu_arena().bucket_numels(MISSING), RuntimeError,
                            "out of range"),
    "Arena.bucket_numel": (lambda: cpu_arena().bucket_numel(MISSING), RuntimeError, "out of range"),
    "Arena.bucket_nbytes": (lambda: cpu_arena().bucket_nbytes(MISSING), RuntimeError,
                            "out of range"),
    "Arena.param_views": (lambda: cpu_arena().param_views(MISSING), RuntimeError, "out of range"),
    "Arena.grad_views": (lambda: cpu_arena(requires_grad=False).grad_views(0), RuntimeError,
                         "no gradients"),
    "Arena.swap_live": (lambda: cpu_arena().swap_live(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.refresh": (lambda: cpu_arena().refresh(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.wait": (lambda: cpu_arena().wait(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.slot_views": (lambda: with_slot()[0].slot_views(0, MISSING), RuntimeError,
                         "out of range"),
    "Arena.slot_flat": (lambda: cpu_arena().slot_flat(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.restore": (lambda: cpu_arena().restore(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.pins": (lambda: cpu_arena().pins(MISSING), RuntimeError, "does not exist"),
    "Arena.refcount": (lambda: cpu_arena().refcount(MISSING), RuntimeError, "does not exist"),
    "Arena.pin": (lambda: cpu_arena().pin(MISSING, 0), RuntimeError, "does not exist"),
    "Arena.release": (lambda: with_slot(pin=1)[0].release(0, 2, 0), RuntimeError,
                      "not pinned to micro-batch 2"),
    "Arena.free_slot": (lambda: (lambda a_s: a_s[0].free_slot(a_s[1], 0))(held_slot()),
                        RuntimeError, "double buffer"),
    "Arena.hold": (lambda: cpu_arena().hold(MISSING), RuntimeError, "does not exist"),
    "Arena.unhold": (lambda: (lambda a_s: a_s[0].unhold(a_s[1], 0))(with_slot()), RuntimeError,
                     "not held by a double buffer"),
    "Arena.set_l2_persistence": (lambda: cpu_arena().set_l2_persistence(MISSING, 0, 1.0, 0),
                                 RuntimeError, "out of range"),
    "Arena.clear_l2_persistence": (lambda: cpu_arena().clear_l2_persistence(MISSING, 0),
                                   RuntimeError, "out of range"),
    "Arena.set_l2_window": (lambda: cpu_arena().set_l2_window(MISSING, 0, 1.0, 0), RuntimeError,
                            "out of range"),
    "Arena.clear_l2_window": (lambda: cpu_arena().clear_l2_window(MISSING, 0), RuntimeError,
                              "out of range"),
    "Arena.trace_start": (lambda: with_slot()[0].trace_start(False), RuntimeError,
                          "before its first snapshot"),
    "Arena.trace_take": (lambda: cpu_arena().trace_take(), RuntimeError, "not traced"),
}

# Bindings that throw only on a CUDA runtime failure (or never): guarded like the others,
# but no input makes them throw on purpose.
NO_TRIGGER = {
    "build_info", "sgd_cpu_variant", "l2_device", "set_persisting_l2",
    "Arena.alignment", "Arena.num_buckets", "Arena.snapshot", "Arena.new_slot",
    "Arena.wait_all", "Arena.has_slot", "Arena.was_freed", "Arena.slot_ids",
    "Arena.trim_pool", "Arena.snapshot_stream", "Arena.live_bytes", "Arena.grad_bytes",
    "Arena.slot_bytes", "Arena.pooled_bytes", "Arena.peak_bytes", "Arena.per_slot_bytes",
}


def bound_names() -> set[str]:
    names = {n for n in dir(_C) if not n.startswith("_") and callable(getattr(_C, n))
             and n != "Arena"}
    names |= {f"Arena.{n}" for n in vars(_C.Arena) if not n.startswith("_")}
    return names | {"Arena.__init__"}


def test_every_binding_is_classified() -> None:
    names = bound_names()
    missing = names - set(TRIGGERS) - NO_TRIGGER
    assert not missing, f"bindings with no raising test and not listed in NO_TRIGGER: {missing}"
    stale = (set(TRIGGERS) | NO_TRIGGER) - names
    assert not stale, f"listed here but not bound in engine._C: {stale}"


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_binding_raises_python_exception(name: str) -> None:
    call, exc, pattern = TRIGGERS[name]
    with pytest.raises(exc, match=pattern):
        call()


def test_add_bucket_after_a_snapshot_raises() -> None:
    with pytest.raises(RuntimeError, match="before the first snapshot"):
        _snapshot_then_add()


def test_a_refused_call_changes_nothing() -> None:
    a, s = held_slot()
    with pytest.raises(RuntimeError, match="double buffer"):
        a.free_slot(s, 0)
    assert a.has_slot(s) and a.refcount(s) == 1
    assert a.unhold(s, 0) is True and not a.has_slot(s)


def test_the_error_message_carries_no_cpp_backtrace() -> None:
    with pytest.raises(RuntimeError) as info:
        _C.Arena(3)
    assert "Exception raised from" not in str(info.value)


def test_free_of_a_held_slot_raises_in_a_fresh_process() -> None:
    """The H100 crash (issue 22), in a child: a segfault there fails this test only."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = textwrap.dedent(f"""
        import torch
        from torch import nn
        from engine.arena import flatten_
        arena = flatten_(nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 3)).to({device!r}))
        db = arena.rotation()
        try:
            arena.free(db.back)
        except RuntimeError as e:
            assert "double buffer" in str(e), e
            print("raised")
        db.close()
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "raised"
