"""A real Ctrl-C (SIGINT) during a local step (engine/runtime/exec/interrupts.py): deferred to
the next action boundary (a synchronous step rolls back there), a second one at once, the
program's own handler left alone, an ignored SIGINT left ignored, and SIGINT's handler as it
was after every step. (engine.testing's FaultInjector raises KeyboardInterrupt from the action
hook instead; this is the signal path itself.)

Every test here starts from Python's default handler (the ``sigint_default`` fixture of
conftest.py): a process started in the background inherits SIGINT as ignored, and the suite
must pass there too (the last tests check that)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine import Pipeline

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "kill"), reason="needs os.kill"),
    pytest.mark.usefixtures("sigint_default"),
]
TESTS = Path(__file__).resolve().parents[1]


class _Sigint(nn.Module):
    """A Linear whose next forward sends this process ``times`` SIGINTs (or raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.times = 0
        self.boom = False  # raise ValueError instead

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.boom:
            raise ValueError("injected failure in the user's forward")
        for _ in range(self.times):
            os.kill(os.getpid(), signal.SIGINT)
        self.times = 0
        return self.lin(x)


def _pipe() -> Pipeline:
    """After one step: the first step's dry run calls the modules outside any step."""
    torch.manual_seed(0)
    pipe = Pipeline(
        [_Sigint(), nn.Linear(4, 4)], schedule="gpipe", chunks=2,
        loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )
    pipe.step(*_batch())
    return pipe


def _weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)


def _raised_inside_the_forward(info: pytest.ExceptionInfo[BaseException]) -> bool:
    return any(e.name == "forward" and str(e.path).endswith("test_interrupts.py") for e in info.traceback)


def _interrupted_step(times: int) -> tuple[Pipeline, pytest.ExceptionInfo[BaseException]]:
    """A step whose first stage's forward sends ``times`` SIGINTs: it raises KeyboardInterrupt
    and rolls back (no step counted, weights as before), SIGINT's handler restored."""
    pipe = _pipe()
    before = _weights(pipe)
    pipe.stages[0].module.times = times
    with pytest.raises(KeyboardInterrupt) as info:
        pipe.step(*_batch())
    assert pipe.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(pipe), strict=True))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return pipe, info


def test_a_ctrl_c_stops_at_the_next_action_and_rolls_the_step_back() -> None:
    pipe, info = _interrupted_step(1)
    assert not _raised_inside_the_forward(info)  # deferred: the forward completed
    assert "the step was rolled back" in "\n".join(getattr(info.value, "__notes__", []))
    pipe.step(*_batch())  # and it goes on
    assert pipe.steps == 2


def test_a_second_ctrl_c_interrupts_at_once_and_rolls_back() -> None:
    _, info = _interrupted_step(2)
    assert _raised_inside_the_forward(info)


def test_the_programs_own_handler_is_left_alone() -> None:
    calls: list[int] = []

    def mine(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        pipe = _pipe()
        pipe.stages[0].module.times = 1
        pipe.step(*_batch())  # no KeyboardInterrupt: the program handles SIGINT itself
        assert calls == [signal.SIGINT]
        assert pipe.steps == 2
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigint_is_restored_after_a_step_that_raised() -> None:
    pipe = _pipe()
    pipe.stages[0].module.boom = True
    with pytest.raises(ValueError, match="user's forward"):
        pipe.step(*_batch())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("times", [1, 2])
def test_an_ignored_sigint_stays_ignored_and_defers_nothing(times: int) -> None:
    """A program that ignores SIGINT (SIG_IGN: inherited by anything started with ``&`` or
    ``nohup``) keeps ignoring it: the step runs to its end, equal to an uninterrupted one,
    nothing is left pending for the next step, and the handler is still SIG_IGN."""
    ref = _pipe()
    ref.step(*_batch())
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pipe = _pipe()
        pipe.stages[0].module.times = times
        pipe.step(*_batch())  # no KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert not pipe.parts.executor.interrupts.pending
        pipe.step(*_batch())  # and none raised a step later
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pipe.steps == 3
    ref.step(*_batch())
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(pipe), strict=True))


# Sends SIGINT to itself or checks the handler, yet may not rely on how pytest was started.
_SIGINT_USE = re.compile(r"signal\.SIGINT|default_int_handler")
_SETS_ITS_HANDLER = re.compile(
    r"sigint_default|signal\.signal\(\s*signal\.SIGINT,\s*signal\.default_int_handler\)"
)


def test_every_test_module_that_uses_sigint_sets_its_handler() -> None:
    """A module that sends SIGINT or checks its handler requests ``sigint_default`` (or, in
    a spawned worker, sets the default handler itself); otherwise it fails only when the
    suite runs in the background."""
    users = [p for p in sorted(TESTS.rglob("*.py"))
             if p.name != "conftest.py" and _SIGINT_USE.search(p.read_text())]
    assert {"test_interrupts.py", "test_runtime_capture.py"} <= {p.name for p in users}
    assert [p.name for p in users if not _SETS_ITS_HANDLER.search(p.read_text())] == []


# The local tests that send SIGINT; test_distributed_failures' workers take minutes.
_SIGINT_TESTS = [
    "tests/runtime/test_interrupts.py",
    "tests/runtime/capture/test_runtime_capture.py::test_ctrl_c_during_a_replay_finishes_the_step_then_raises",
    "tests/runtime/capture/test_capture_async.py::test_ctrl_c_during_a_replay_finishes_the_step_then_raises",
]
_STARTED_IGNORING = (
    "import signal, sys, pytest\n"
    "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, 'SIGINT was not inherited ignored'\n"
    "sys.exit(pytest.main(sys.argv[1:]))\n"
)


def test_the_sigint_tests_pass_in_a_process_that_ignores_sigint() -> None:
    """As under ``nohup pytest ... &``: the child inherits SIGINT as ignored (checked in the
    child before pytest starts) and the tests that send SIGINT pass as in the foreground."""
    this = (f"{Path(__file__).resolve().relative_to(TESTS.parent)}::"
            f"{test_the_sigint_tests_pass_in_a_process_that_ignores_sigint.__name__}")
    proc = subprocess.run(
        [sys.executable, "-c", _STARTED_IGNORING, "-q", "-p", "no:cacheprovider",
         "-o", "addopts=--strict-markers", f"--deselect={this}", *_SIGINT_TESTS],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\b(1[0-9]|[5-9]) passed", tail), tail
