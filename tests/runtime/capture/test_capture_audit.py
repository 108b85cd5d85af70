"""CUDA-graph capture preconditions on CPU (engine.runtime.capture.audit, issue 23 item 4).

Two kinds of tests: every schedule family x mitigation of the catalog is audited and today's
state is recorded exactly (which of the four preconditions its steady-state window meets and,
for each one it misses, why); and each precondition is broken on purpose, where the audit
must say so. When the runtime grows static buffers, the table below changes with it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.optim
from engine.errors import PipelineConfigError
from engine.schedule.catalog import FAMILIES, SCHEDULES
from engine.runtime.capture.audit import CHECKS, audit, audit_pipeline

S, M, D = 3, 3, 4

#: optimizer options, pipeline options
MITIGATIONS = {
    "plain": ({}, {}),
    "sc": ({"spike_compensation": True}, {}),
    "sc+lwp": ({"spike_compensation": True, "prediction": "linear"}, {"weight_prediction": "lwp"}),
    "spectrain": ({"prediction": "linear"}, {"weight_prediction": "spectrain"}),
    "t2": ({"discrepancy_correction": True}, {}),
    "skip_update": ({"spike_compensation": True}, {"on_nonfinite": "skip_update"}),
}

INPUT = "input batch (needs a static staging buffer)"
EARLIER_INPUT = "an earlier step's input batch (needs a static staging buffer)"
CARRIED = "made by the previous window (needs a static hand-over buffer)"
BEFORE = "made before the window (needs a static buffer)"
ROTATE = "weight buffers (live and version slots rotate)"
#: the reference optimizer path (what CPU runs with PE_CPU_LOOP=0) reads found_inf on the
#: host; the fused CUDA kernels read it on the device (engine/optim/functional.py:_skip)
REFERENCE_SKIP = "engine/optim/functional.py:_skip"


def accepted(schedule: str, mitigation: str) -> bool:
    """Whether the pipeline accepts the combination (prediction and T2 need pb's live
    asynchronous weights; spike compensation a delay, which synchronous schedules lack)."""
    fam = FAMILIES[schedule]
    if fam.synchronous:
        return mitigation in ("plain", "skip_update")
    return fam.weights == "live" or mitigation in ("plain", "sc", "skip_update")


def _options(schedule: str, mitigation: str) -> tuple[dict, dict]:
    """The mitigation's options; skip_update runs without spike compensation where the
    schedule has no delay to compensate (a synchronous schedule refuses it)."""
    opt_kw, pipe_kw = MITIGATIONS[mitigation]
    if mitigation == "skip_update" and FAMILIES[schedule].synchronous:
        opt_kw = {}
    return opt_kw, pipe_kw


def factory(schedule: str, mitigation: str, stage: type[nn.Module] | None = None):
    opt_kw, pipe_kw = _options(schedule, mitigation)

    def make() -> engine.Pipeline:
        torch.manual_seed(0)
        stages: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
        stages.append(nn.Linear(D, 2))
        if stage is not None:
            stages[1] = nn.Sequential(stages[1], stage())
        return engine.Pipeline(
            stages, schedule=schedule, chunks=M, loss_fn=F.mse_loss,
            optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9, **opt_kw),
            checkpoint="never", **pipe_kw,
        )

    return make


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2 * M, D, generator=g), torch.randn(2 * M, 2, generator=g)) for _ in range(n)]


def expected(schedule: str, mitigation: str) -> tuple[set[str], dict[str, int]]:
    """Today's state: why each window's outside tensors move, and its host syncs."""
    fam = FAMILIES[schedule]
    if fam.synchronous:
        # a synchronous window is a whole step: only the user's batch comes from outside;
        # the one host read is the loss check before the update phase (on_nonfinite, also
        # "skip_update", which acts as "skip" on synchronous schedules)
        return {INPUT}, {"engine/runtime/exec/protocol.py:_take_losses": 1}
    moved = {INPUT, EARLIER_INPUT, CARRIED, BEFORE}
    if fam.weights != "live":
        moved.add(ROTATE)  # stashed versions / 2BW's double buffer live in rotating slots
    if mitigation == "skip_update":
        # the runtime reads nothing: the only reads are the reference optimizer's found_inf
        updates = {"pb": S * M, "pipedream": S * M, "2bw": S}[schedule]
        return moved, {REFERENCE_SKIP: updates}
    return moved, {"engine/runtime/exec/executor.py:_forward": M}  # loss.item() per micro-batch


CASES = [(s, m) for s, m in itertools.product(SCHEDULES, MITIGATIONS) if accepted(s, m)]


def test_matrix_covers_the_catalog() -> None:
    assert {s for s, _ in CASES} == set(SCHEDULES)
    assert {m for _, m in CASES} == set(MITIGATIONS)
    for s, m in itertools.product(SCHEDULES, MITIGATIONS):
        if not accepted(s, m):
            with pytest.raises(PipelineConfigError):
                factory(s, m)()


@pytest.mark.parametrize(("schedule", "mitigation"), CASES)
def test_steady_state_window(schedule: str, mitigation: str) -> None:
    report = audit_pipeline(factory(schedule, mitigation), batches(), name=f"{schedule}/{mitigation}")
    # met today by every window: the same calls with the same constants, and bitwise eager
    report.assert_ok("same_ops", "bitwise_eager")
    moved, syncs = expected(schedule, mitigation)
    assert set(report.reasons("static_addresses")) == moved, report.describe()
    assert report.reasons("no_host_sync") == syncs, report.describe()


@pytest.mark.parametrize("mitigation", ["plain", "skip_update"])
def test_interleaved_window(mitigation: str) -> None:
    """Interleaved 1F1B (not a catalog row: ``virtual_stages``) is synchronous like its peers."""
    opt_kw, pipe_kw = _options("1f1b", mitigation)

    def make() -> engine.Pipeline:
        torch.manual_seed(0)
        stages: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)]
        return engine.Pipeline(
            [*stages, nn.Linear(D, 2)], schedule="interleaved", virtual_stages=2, chunks=4,
            loss_fn=F.mse_loss, checkpoint="never", **pipe_kw,
            optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9, **opt_kw),
        )

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, D, generator=g), torch.randn(8, 2, generator=g)) for _ in range(4)]
    report = audit_pipeline(make, data, name=f"interleaved/{mitigation}")
    report.assert_ok("same_ops", "bitwise_eager")
    moved, syncs = expected("1f1b", mitigation)
    assert set(report.reasons("static_addresses")) == moved
    assert report.reasons("no_host_sync") == syncs


def _pb(optimizer, **kw):
    def make() -> engine.Pipeline:
        torch.manual_seed(0)
        stages: list[nn.Module] = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S - 1)]
        return engine.Pipeline([*stages, nn.Linear(D, 2)], schedule="pb", chunks=M,
                               loss_fn=F.mse_loss, optimizer=optimizer, checkpoint="never",
                               on_nonfinite="skip_update", **kw)
    return make


def test_an_lr_schedule_changes_the_calls_constants() -> None:
    """Today's learning rate is a Python number in the update's calls: a schedule changes a
    constant every step, so a captured window would replay a stale rate (the design: LR as
    a device tensor)."""
    make = _pb(lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9),
               lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9))
    report = audit_pipeline(make, batches())
    assert report.reasons("same_ops") == {"constant argument differs": 1}
    report.assert_ok("bitwise_eager")


@pytest.mark.parametrize("opt", ["Adam", "AdamW"])
def test_adams_reference_path_reads_its_step(opt: str) -> None:
    """The CPU (reference) Adam reads its step count on the host and passes the bias
    correction as a number that changes every step; the fused CUDA kernels take the step as
    a device tensor (what only a GPU run of the capture can confirm)."""
    make = _pb(lambda p: getattr(engine.optim, opt)(p, lr=0.01))
    report = audit_pipeline(make, batches())
    assert report.reasons("same_ops") == {"constant argument differs": 1}
    assert set(report.reasons("no_host_sync")) == {REFERENCE_SKIP, "engine/optim/functional.py:adam_update"}
    report.assert_ok("bitwise_eager")


# ---------------------------------------------------------------------- broken on purpose


class Alternating(nn.Module):
    """Runs a different op on every other call (a Python branch on host state)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 1.0 if self.calls % 2 else x + 0.0


class TwoConstants(nn.Module):
    """Reads one of two equal constants, alternately: same values, moving address."""

    def __init__(self) -> None:
        super().__init__()
        self.consts = [torch.ones(D), torch.ones(D)]
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.consts[self.calls % 2]


class ReadsBack(nn.Module):
    """Branches on a value read from the device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if x.abs().max().item() > 100 else x


SHARED = torch.zeros(())


class SharedState(nn.Module):
    """Reads and bumps state shared by every instance: the audited pipeline and its eager
    twin see different values (same ops, same addresses, different results)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SHARED.add_(1.0)
        return x + SHARED


#: the finding each broken stage must add (None: the check passes on the clean pipeline)
BROKEN_REASON = {
    "same_ops": None,
    "static_addresses": BEFORE,  # TwoConstants' constants were made before the window
    "no_host_sync": "test_capture_audit.py:forward",  # ReadsBack.forward's .item()
    "bitwise_eager": None,
}


@pytest.mark.parametrize(
    ("stage", "broken"),
    [(Alternating, "same_ops"), (TwoConstants, "static_addresses"),
     (ReadsBack, "no_host_sync"), (SharedState, "bitwise_eager")],
)
@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_a_broken_precondition_fails(stage: type[nn.Module], broken: str, schedule: str) -> None:
    clean = audit_pipeline(factory(schedule, "skip_update"), batches())
    report = audit_pipeline(factory(schedule, "skip_update", stage), batches())
    assert not report.ok(broken), report.describe()
    reason = BROKEN_REASON[broken]
    if reason is None:
        assert clean.ok(broken), clean.describe()
    else:  # the clean window may miss this precondition already, for other reasons
        assert report.reasons(broken).get(reason, 0) > clean.reasons(broken).get(reason, 0)
    with pytest.raises(AssertionError, match=broken):
        report.assert_ok(broken)


def _static_window():
    """A window on preallocated tensors only, updated in place."""
    w = torch.randn(D, D)
    x = torch.randn(2, D)
    out = torch.empty(2, D)

    def window(r: int) -> torch.Tensor:
        torch.mm(x, w, out=out)
        w.add_(out.sum(0), alpha=-1e-3)
        return w.clone()

    return window


def test_a_static_window_passes() -> None:
    """Everything in place on preallocated tensors: all four preconditions hold."""
    torch.manual_seed(0)
    win = _static_window()
    torch.manual_seed(0)
    twin = _static_window()
    report = audit(win, eager=twin)
    report.assert_ok()
    assert report.ops[0] == report.ops[1] > 0


@pytest.mark.parametrize(
    "sync",
    [lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: torch.nonzero(t),
     lambda t: t[t > 0], lambda t: torch.equal(t, t), lambda t: t.unique()],
    ids=["item", "bool", "nonzero", "mask-index", "equal", "unique"],
)
def test_host_syncs_are_found(sync) -> None:
    t = torch.randn(8)
    report = audit(lambda r: [sync(t)] and None)
    assert not report.ok("no_host_sync"), report.describe()
    assert report.ok("same_ops") and report.ok("static_addresses")


def test_fresh_inputs_and_constants_are_found() -> None:
    w = torch.randn(D)
    fresh = audit(lambda r: torch.randn(D) * w)  # randn is made inside: fine
    assert fresh.ok("static_addresses")
    xs = [torch.randn(D), torch.randn(D)]
    moved = audit(lambda r: xs[r] * w)  # an outside input at a new address each time
    assert set(moved.reasons("static_addresses")) == {BEFORE}
    lrs = [0.1, 0.2]
    scalar = audit(lambda r: w.mul(lrs[r]))  # a learning rate as a Python number
    assert set(scalar.reasons("same_ops")) == {"constant argument differs"}
    grow = audit(lambda r: torch.zeros(r + 1) + 1)
    assert not grow.ok("same_ops")


def test_checks_are_named() -> None:
    report = audit(lambda r: None)
    assert report.summary() == dict.fromkeys(CHECKS, True)
    with pytest.raises(ValueError, match="unknown check"):
        report.ok("fast")
