"""The CUDA-graph capture preconditions of a pipeline's steady-state window, checked on a CPU.

Why: a CUDA graph replays the kernels one capture recorded, with their pointers and scalar
arguments frozen. Replaying a window of a step program is therefore only correct when (issue
23, item 4) running that window again would

1. **make the same calls**: the same aten ops in the same order with the same non-tensor
   arguments (a learning rate or a step count passed as a Python number is frozen in);
2. **touch the same memory**: every tensor from *outside* the window that an op reads or
   writes (weights, gradients, optimizer state, staged inputs, activations handed over from
   the previous window) sits at the same address both times, and every tensor made *inside*
   the window is consumed by the same op both times (the graph's private pool gives those
   fixed addresses by itself);
3. **never wait for the host**: no ``.item()``, ``bool(tensor)``, ``nonzero``, data-dependent
   shapes or device-to-host copies (capture refuses them, or freezes a branch taken once);
4. **compute what eager computes**, bit for bit.

All four are visible below autograd with a ``TorchDispatchMode``
(:mod:`engine.runtime.capture.dispatch_trace`), so CPU CI can say which windows a capture layer may
record today and why the others may not, long before a GPU proves the replay. :func:`audit`
checks any callable window; :func:`audit_pipeline` runs a pipeline's steady state -- one
``step()``: a synchronous schedule's whole step, an asynchronous one's step worth of ticks --
twice under the recorder, next to an identical pipeline run eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from engine.runtime.capture.dispatch_trace import Access, OpRecord, Recorder

__all__ = ["CHECKS", "AuditReport", "Finding", "audit", "audit_pipeline", "compare_recordings"]

#: the preconditions, in the order above
CHECKS = ("same_ops", "static_addresses", "no_host_sync", "bitwise_eager")


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str  # one of CHECKS
    op: int | None  # op index in the second recording (None: not about one op)
    reason: str  # a short category, stable across runs (the summary counts these)
    detail: str


@dataclasses.dataclass
class AuditReport:
    """What :func:`audit` found. ``ok(check)`` per precondition; ``reasons(check)`` counts the
    findings' categories (what a test records as today's state)."""

    name: str
    ops: tuple[int, ...]
    findings: list[Finding]

    def ok(self, check: str) -> bool:
        if check not in CHECKS:
            raise ValueError(f"unknown check {check!r}; choose from {', '.join(CHECKS)}")
        return not any(f.check == check for f in self.findings)

    def reasons(self, check: str) -> dict[str, int]:
        self.ok(check)
        return dict(Counter(f.reason for f in self.findings if f.check == check))

    def summary(self) -> dict[str, bool]:
        return {c: self.ok(c) for c in CHECKS}

    def describe(self, limit: int = 3) -> str:
        lines = [f"{self.name}: {len(self.ops) and self.ops[-1]} ops per window"]
        for c in CHECKS:
            found = [f for f in self.findings if f.check == c]
            lines.append(f"  {c}: {'ok' if not found else f'{len(found)} findings {self.reasons(c)}'}")
            lines += [f"    op {f.op}: {f.detail}" for f in found[:limit]]
        return "\n".join(lines)

    def assert_ok(self, *checks: str) -> None:
        bad = [c for c in (checks or CHECKS) if not self.ok(c)]
        if bad:
            raise AssertionError(f"capture preconditions {bad} fail:\n{self.describe()}")


# ---------------------------------------------------------------------- comparing recordings


CARRIED = "made by the previous window (needs a static hand-over buffer)"


def _where(a: Access, labels: Callable[[Access], str] | None, previous: dict[int, int]) -> str:
    name = labels(a) if labels is not None else None
    if name:
        return name
    if a.storage in previous:
        return CARRIED
    return "made before the window (needs a static buffer)"


def compare_recordings(
    first: list[OpRecord],
    second: list[OpRecord],
    *,
    labels: Callable[[Access], str | None] | None = None,
    previous: dict[int, int] | None = None,
) -> list[Finding]:
    """Findings of checks 1-3 between two recordings of the same window; ``labels`` names
    what an outside tensor of the second recording is (its finding's reason; None: unknown),
    ``previous`` is the first recording's ``allocated`` map (values it handed over)."""
    out: list[Finding] = []
    if len(first) != len(second):
        out.append(Finding("same_ops", None, "op count differs",
                           f"{len(first)} ops, then {len(second)}"))
    for a, b in zip(first, second, strict=False):
        if a.name != b.name or a.constants != b.constants:
            what = "op differs" if a.name != b.name else "constant argument differs"
            out.append(Finding("same_ops", b.index, what,
                               f"{a.name}({a.constants}) then {b.name}({b.constants})"))
            break  # everything after a divergence is misaligned
        if [(x.role, x.shape, x.dtype) for x in a.accesses] != [(x.role, x.shape, x.dtype) for x in b.accesses]:
            out.append(Finding("same_ops", b.index, "tensor shapes differ", f"{b.name}"))
            break
        for x, y in zip(a.accesses, b.accesses, strict=True):
            inside = (x.source is not None, y.source is not None)
            if inside == (True, True):
                if (x.source, x.ptr - x.storage) != (y.source, y.ptr - y.storage):
                    out.append(Finding("static_addresses", b.index, "different producer inside",
                                       f"{b.name} {y.role}: made by op {x.source}, then op {y.source}"))
            elif x.ptr != y.ptr or inside != (False, False) or y.storage in (previous or {}):
                # a value the first recording made and the second reads is a fresh allocation
                # even when it lands at the same address: a replay would read the capture's
                reason = _where(y, labels, previous or {})
                out.append(Finding("static_addresses", b.index, reason,
                                   f"{b.name} {'writes' if y.write else 'reads'} {y.role} "
                                   f"{list(y.shape)} {reason}: {x.ptr:#x} then {y.ptr:#x}"))
    for rec in (first, second):
        for op in rec:
            if op.sync is not None:
                out.append(Finding("no_host_sync", op.index, f"{op.where}",
                                   f"{op.name} {op.sync}, called from {op.where}"))
        if rec is first:  # report each host sync once (the second recording's)
            out = [f for f in out if f.check != "no_host_sync"]
    return out


def _bitwise(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit (NaNs compare by their bits too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _compare_results(ours: Sequence[Tensor | None], theirs: Sequence[Tensor | None], window: int) -> list[Finding]:
    if len(ours) != len(theirs):
        return [Finding("bitwise_eager", None, "result count differs", f"window {window}")]
    out = []
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if (a is None) != (b is None) or (a is not None and b is not None and not _bitwise(a, b)):
            out.append(Finding("bitwise_eager", None, "result differs",
                               f"window {window}: result {k} differs from the eager run"))
    return out


def audit(
    window: Callable[[int], Any],
    *,
    eager: Callable[[int], Any] | None = None,
    results: Callable[[Any], Sequence[Tensor | None]] | None = None,
    labels: Callable[[Access, int], str | None] | None = None,
    name: str = "window",
) -> AuditReport:
    """Run ``window(0)`` and ``window(1)`` under a :class:`Recorder` and check the four
    preconditions (module docstring). ``eager(r)``, when given, runs the same window on an
    identical twin without the recorder; ``results`` turns a window's (and the twin's) return
    value into the tensors compared bit for bit, outside the recorder (default: the value
    itself, a tensor or a sequence of them). The RNG
    state is the same for both sides of a window. ``labels(access, r)`` names an outside
    tensor of window r whose address moved."""
    recorders: list[Recorder] = []
    findings: list[Finding] = []
    pick = results or (lambda v: [v] if isinstance(v, Tensor) or v is None else list(v))
    for r in range(2):
        rng = torch.get_rng_state()
        rec = Recorder()
        with rec:
            value = window(r)
        recorders.append(rec)
        if eager is not None:
            got = pick(value)  # outside the recorder: snapshots are not part of the window
            after = torch.get_rng_state()
            torch.set_rng_state(rng)
            ref = eager(r)
            if not torch.equal(after, torch.get_rng_state()):
                findings.append(Finding("bitwise_eager", None, "RNG state differs",
                                        f"window {r} drew different random numbers than eager"))
            findings += _compare_results(got, pick(ref), r)
    lab = (lambda a: labels(a, 1)) if labels is not None else None
    first, second = recorders
    findings = compare_recordings(first.ops, second.ops, labels=lab, previous=first.allocated) + findings
    return AuditReport(name, (len(first.ops), len(second.ops)), findings)


# ---------------------------------------------------------------------- pipelines


@contextlib.contextmanager
def _reference_optimizer() -> Iterator[None]:
    """Route engine.optim's CPU SGD steps through torch ops (``PE_CPU_LOOP=0``): the C++ loop
    is invisible to a dispatch mode; the ops read and write the same tensors, bit for bit."""
    old = os.environ.get("PE_CPU_LOOP")
    os.environ["PE_CPU_LOOP"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["PE_CPU_LOOP"]
        else:
            os.environ["PE_CPU_LOOP"] = old


def _state(pipe: Any) -> list[Tensor]:
    """What a step leaves behind: live weights, gradient buffers, optimizer state."""
    out: list[Tensor] = []
    for st in pipe.stages:
        out += [f.detach().clone() for f in st.store.live_flats()]
        out += [f.detach().clone() for f in st.store.grad_flats()]
        if st.bridge is not None and st.bridge.opt is not None:
            for state in st.bridge.opt.state.values():
                out += [v.detach().clone() for _, v in sorted(state.items()) if isinstance(v, Tensor)]
    return out


def _pipeline_labels(pipe: Any, batches: Sequence[tuple[Any, Any]], warmup: int
                     ) -> Callable[[Access, int], str | None]:
    """Names an outside tensor: the step's input batch, a stage's weights/gradients/optimizer
    state (a moved one would be a bug), or a value the previous window made (carried)."""
    static: list[tuple[int, int, str]] = []
    for st in pipe.stages:
        store = st.store
        weights = [*store.live_flats(), *store.slot_flats()]
        for f in weights:
            static.append((f.data_ptr(), f.numel() * f.element_size(),
                           "weight buffers (live and version slots rotate)"))
        for f in store.grad_flats():
            static.append((f.data_ptr(), f.numel() * f.element_size(), "gradient buffers moved"))

    def name(a: Access, r: int) -> str | None:
        for k in range(warmup + r, -1, -1):
            for t in _leaves(batches[k]):
                lo = t.untyped_storage().data_ptr()
                if lo <= a.ptr < lo + t.untyped_storage().nbytes():
                    return ("input batch (needs a static staging buffer)" if k == warmup + r else
                            "an earlier step's input batch (needs a static staging buffer)")
        for lo, n, what in static:
            if lo <= a.ptr < lo + n:
                return what
        return None

    return name


def _leaves(x: Any) -> list[Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(x)[0] if isinstance(t, Tensor)]


def audit_pipeline(
    make: Callable[[], Any],
    batches: Sequence[tuple[Any, Any]],
    *,
    warmup: int = 2,
    name: str = "pipeline",
) -> AuditReport:
    """Audit one ``step()`` in steady state: ``make()`` builds the pipeline (called twice,
    so it must be deterministic: seed inside it); ``warmup`` steps fill it, then steps
    ``warmup`` and ``warmup + 1`` are recorded and compared with the eager twin's (the loss
    and every stage's weights, gradients and optimizer state after the step)."""
    if len(batches) < warmup + 2:
        raise ValueError(f"audit_pipeline needs warmup + 2 = {warmup + 2} batches, got {len(batches)}")
    with _reference_optimizer():
        pipe, twin = make(), make()
        for x, y in batches[:warmup]:
            pipe.step(x, y)
            twin.step(x, y)

        def window(r: int) -> tuple[Tensor, Any]:
            x, y = batches[warmup + r]
            return pipe.step(x, y), pipe

        def eager(r: int) -> tuple[Tensor, Any]:
            x, y = batches[warmup + r]
            return twin.step(x, y), twin

        return audit(window, eager=eager, results=lambda v: [v[0], *_state(v[1])],
                     labels=_pipeline_labels(pipe, batches, warmup), name=name)
