"""What capturing an asynchronous window needs, measured on CPU for every accepted schedule x
mitigation (engine.runtime.capture.carry, engine.runtime.capture.carry_audit; issue 23 items 1 and 4).

An asynchronous window (one ``step()`` of pb, PipeDream or 2BW in steady state) can be
replayed from a graph only when every tensor it reads from outside is static or carried
from a fixed operation of a fixed earlier window (a ring of slots), it reads nothing on the
host, and its host counters advance by the same amount every window (a replay runs no
Python). The table below is today's measurement at S = M = 3; each precondition is also
broken on purpose, and the plan must say so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.runtime.capture.carry import fingerprint, host_affine, plan_carry
from engine.schedule.catalog import FAMILIES, SCHEDULES
from engine.runtime.capture.carry_audit import plan_pipeline
from engine.runtime.capture.dispatch_trace import Recorder
from test_capture_audit import D, MITIGATIONS, accepted, factory

ASYNC = [s for s in SCHEDULES if not FAMILIES[s].synchronous]
CASES = [(s, m) for s in ASYNC for m in MITIGATIONS if accepted(s, m)]
#: (period, ring depth) per schedule at S = M = 3: pb carries activations and targets up
#: to two windows back; PipeDream and 2BW one window, and their weight versions alternate
#: between two buffers (a cycle of two graphs)
EXPECTED = {"pb": (1, 2), "pipedream": (2, 1), "2bw": (2, 1)}


def batches(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, D, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def with_skip_update(schedule: str, mitigation: str, stage: type[nn.Module] | None = None):
    """The case's pipeline with on_nonfinite="skip_update" (no host read per micro-batch:
    what a captured asynchronous window needs)."""
    import engine.runtime.pipeline as P

    make = factory(schedule, mitigation, stage)

    def build():
        real = P.Pipeline.__init__

        def init(self, *a, **kw):
            kw["on_nonfinite"] = "skip_update"
            real(self, *a, **kw)

        P.Pipeline.__init__ = init
        try:
            return make()
        finally:
            P.Pipeline.__init__ = real

    return build


def test_cases_cover_every_asynchronous_family() -> None:
    assert {s for s, _ in CASES} == {"pb", "pipedream", "2bw"}
    assert {m for s, m in CASES if s == "pb"} == set(MITIGATIONS)


@pytest.mark.parametrize(("schedule", "mitigation"), CASES)
def test_skip_update_windows_can_be_carried(schedule: str, mitigation: str) -> None:
    plan = plan_pipeline(with_skip_update(schedule, mitigation), batches())
    assert plan.capturable, plan.describe()
    c = plan.carry
    assert (c.period, c.depth) == EXPECTED[schedule], plan.describe()
    assert c.carried and c.staged == 12 and plan.host_moving > 0


@pytest.mark.parametrize(("schedule", "mitigation"), [c for c in CASES if c[1] != "skip_update"])
def test_raise_reads_every_loss_on_the_host(schedule: str, mitigation: str) -> None:
    """on_nonfinite="raise" (the default) reads each micro-batch's loss: not capturable."""
    plan = plan_pipeline(factory(schedule, mitigation), batches())
    assert not plan.capturable
    assert len(plan.carry.host_reads) == 3  # M
    assert all("executor.py:_forward" in r for r in plan.carry.host_reads)


# ---------------------------------------------------------------------- broken on purpose


class EveryFifth(nn.Module):
    """Another op at every fifth call: with 3 calls a window, a cycle of 5 windows."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 1.0 if self.calls % 5 else x + 0.0


class ThreeConstants(nn.Module):
    """Equal constants at three addresses in turn (no cycle of one or two windows)."""

    def __init__(self) -> None:
        super().__init__()
        self.consts = [torch.ones(D) for _ in range(3)]
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.consts[(self.calls // 3) % 3]


class ReadsBack(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if x.abs().max().item() > 100 else x


class WritesCarried(nn.Module):
    """Writes in place into a tensor an earlier call (the previous window's last) made."""

    def __init__(self) -> None:
        super().__init__()
        self.prev: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.prev.add_(1.0)
        self.prev = (x * 2.0).detach()
        return x


@pytest.mark.parametrize(("stage", "words"), [
    (EveryFifth, "then"),
    (ThreeConstants, "origin moves between windows"),
    (WritesCarried, "writes in place into a tensor made 1 window(s) back"),
])
def test_a_broken_carry_precondition_fails(stage: type[nn.Module], words: str) -> None:
    plan = plan_pipeline(with_skip_update("pb", "plain", stage), batches())
    assert not plan.capturable
    assert any(words in p for p in plan.carry.problems), plan.describe()


def test_a_host_read_fails() -> None:
    plan = plan_pipeline(with_skip_update("pb", "plain", ReadsBack), batches())
    assert not plan.capturable
    assert any("test_capture_async_plan.py:forward" in r for r in plan.carry.host_reads)


def test_a_host_counter_that_does_not_advance_evenly_fails() -> None:
    """A replay adds the same difference every window: a counter that grows by 0, 1, 4, 9..
    cannot be kept up to date."""

    def bump(pipe, w: int) -> None:
        pipe.parts.executor.stages[0].updates += w * w

    plan = plan_pipeline(with_skip_update("pb", "plain"), batches(), before_window=bump)
    assert not plan.capturable
    # the counter itself, and what stage 0 derives from it (versions its forwards read)
    assert any(p.startswith("executor.by_index[0]") and "steps differ" in p
               for p in plan.host_problems), plan.describe()


def test_plan_carry_on_a_hand_made_ring() -> None:
    """A window that reads what the window two back made, and writes its own: depth 2."""
    w = torch.ones(4)
    made: list[torch.Tensor] = []
    recs = []
    for _ in range(7):  # the first two windows make their input (not steady state yet)
        rec = Recorder()
        with rec:
            older = made[-2] if len(made) >= 2 else torch.zeros(4)
            made.append(older * w + 1.0)
        recs.append(rec)
    plan = plan_carry(recs[2:])
    assert plan.capturable and plan.depth == 2 and plan.slots == 1 and plan.slot_bytes == 2 * 16


def test_host_affine_names_the_field() -> None:
    class State:  # not an engine object: opaque
        pass

    from engine.runtime.exec.result import StepResult

    prints = [fingerprint({"a": n, "k": {n: 1}, "o": State()}) for n in (0, 3, 6)]
    assert host_affine(*prints) == (2, [])
    bad = [fingerprint({"a": n}) for n in (0, 3, 7)]
    moving, problems = host_affine(*bad)
    assert problems == ["host[0]<value>: 0, 3, 7 (steps differ)"]
    assert fingerprint(StepResult(None))[0] == "obj"
