"""One pipeline stage: its module, weight store, optimizer, activation stash and the F/B/U
actions that run on it.

How a forward and a backward get exactly the weights the policy names (see weights.py for
the autograd facts this relies on):

* Without recomputation the backward replays the graph the forward saved, and that graph
  reads the storage the forward ran on. So F runs on LIVE when the backward wants the live
  weights or the same version and nothing will rewrite LIVE in between (sync, pb); on a
  pinned snapshot of the version (pipedream, 2bw); or on a private slot per micro-batch when
  the backward wants other values (LWP, SpecTrain, PipeMare T2), into which B writes W_B
  just before it runs. B always runs under ``use(the forward's buffer)`` so that parameters
  saved by reference read the same values as views saved by builtin ops.
* With recomputation F runs without a graph and B re-runs the stage forward from the stashed
  input *under W_B* (restoring the forward's RNG state), then differentiates it: activations
  and weight reads both come from W_B. For stashing/sync W_B = W_F, so results are identical to
  no recomputation; for the live-weight methods this is the only meaningful reading (the
  forward's weights are gone), and it is what PipeMare's T2 estimates.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from engine.runtime.optim_bridge import OptimizerBridge
from engine.runtime.policy import DoubleBuffered, WeightPolicy
from engine.runtime.probe import action_context, profiling
from engine.runtime.stash import ActivationStash, StashEntry
from engine.runtime.weights import LIVE, make_store

__all__ = ["Stage", "DROPPED"]


class _Dropped:
    """Marker sent upstream instead of a gradient for a micro-batch whose loss was skipped."""

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()
_NO_LABEL = contextlib.nullcontext()


def _label(prefix: str, n: int) -> contextlib.AbstractContextManager[Any]:
    """The profiler label '{prefix}{n}' of an action, only while a profiler records."""
    return record_function(f"{prefix}{n}") if profiling() else _NO_LABEL


class Stage:
    """Stage ``index`` of ``S``: runs F(i), B(i) and U on its own module and optimizer."""

    def __init__(
        self,
        index: int,
        S: int,
        module: nn.Module,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        policy: WeightPolicy,
        recompute: bool,
        loss_fn: Callable[[Tensor, Any], Tensor] | None,
        trace: bool = False,
        weights: str = "auto",
    ) -> None:
        self.index = index
        self.S = S
        self.module = module
        self.policy = policy
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.is_last = index == S - 1
        self.store = make_store(module, weights)
        self.shadow = self.store.optimizer_params()
        opt = optimizer(self.shadow)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer factory returned {type(opt).__name__}; it must return a torch.optim.Optimizer "
                "(e.g. optimizer=lambda params: engine.optim.SGD(params, lr=0.1))"
            )
        self.bridge = OptimizerBridge(opt, self.shadow)
        self.scheduler: Any = None
        #: called with the shadow parameters (grads in place) before each optimizer step:
        #: the data-parallel all-reduce under gloo/NCCL (None: no replicas)
        self.grad_hook: Callable[[list[nn.Parameter]], None] | None = None
        self.stash = ActivationStash()
        self.updates = 0  # t: updates applied so far
        self.segment_updates = 0  # updates at the start of the current segment (2BW's origin)
        self.pending = 0  # backwards accumulated since the last update
        self.pending_weight = 0.0  # sum of their loss scales (1.0 = a full group)
        self.pending_grads = False
        self.pending_mbs: list[int] = []
        self.delay_counts: dict[int, int] = {}
        self.peak_versions = 1
        self.trace = trace
        self.records: dict[int, dict[str, Any]] = {}
        self._t_f: dict[int, int] = {}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.bridge.opt

    # ------------------------------------------------------------------ forward

    def _forward_buffer(self, i: int) -> int:
        kind = self.policy.forward_kind
        store = self.store
        if kind == "version":
            v = self.policy.forward_version(self, i)
            slot = store.find_version(v)
            if slot is None:
                if v != self.updates:
                    raise RuntimeError(
                        f"stage {self.index}: weight version {v} needed by micro-batch {i} is no longer "
                        f"kept (live version {self.updates}); the schedule violates its policy"
                    )
                slot = store.snapshot(v)
            store.pin(slot, i)
            if isinstance(self.policy, DoubleBuffered):
                store.hold(slot, "2bw")
                self._unhold_older(v)
            return slot
        if kind == "values":
            slot = store.slot_with(self.policy.forward_values(self, i))
            store.pin(slot, i)
            return slot
        # live forward: a private copy only if B must later write other values into it
        if not self.recompute and self.policy.backward_kind == "values":
            slot = store.snapshot()
            store.pin(slot, i)
            return slot
        return LIVE

    def _unhold_older(self, version: int) -> None:
        """2BW: versions older than ``version`` are never read by a future forward."""
        for slot in self.store.slots:
            v = self.store.version_of(slot)
            if v is not None and v < version:
                self.store.unhold(slot, "2bw")

    @staticmethod
    def _rng_state(x: Tensor) -> tuple[Tensor, int | None, Tensor | None]:
        """CPU RNG state plus the CUDA device's, so a recomputed forward draws the same
        dropout masks as the original one (what torch.utils.checkpoint preserves too)."""
        if x.is_cuda:
            dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
            return torch.get_rng_state(), dev, torch.cuda.get_rng_state(dev)
        return torch.get_rng_state(), None, None

    def forward(
        self, i: int, n: int, x: Tensor, target: Any, scale: float
    ) -> tuple[Tensor, Tensor | None]:
        """F(i): returns (output for the next stage, detached unscaled loss at the last stage)."""
        with _label(f"stage{self.index}/F", n), action_context(self.index, n, "F"):
            t_f = self.policy.forward_version(self, i)
            fbuf = self._forward_buffer(i)
            self.peak_versions = max(self.peak_versions, self.store.versions_held(self.updates))
            needs_grad = self.index > 0 and x.is_floating_point()
            loss: Tensor | None = None
            if self.recompute:
                rng = self._rng_state(x)
                with torch.no_grad(), self.store.use(fbuf):
                    out = self.module(x)
                    if self.is_last:
                        loss = self.loss_fn(out, target)
                if self.policy.backward_kind != "same" and fbuf != LIVE:
                    self.store.release(fbuf, i)  # transient prediction: B recomputes under W_B
                    fbuf = LIVE
                entry = StashEntry(i, x.detach(), None, fbuf, t_f, scale, target, rng)
            else:
                xin = x.detach().requires_grad_(needs_grad)
                with torch.enable_grad(), self.store.use(fbuf):
                    out = self.module(xin)
                    if self.is_last:
                        loss = self.loss_fn(out, target)
                keep = loss * scale if self.is_last else out
                entry = StashEntry(i, xin, keep, fbuf, t_f, scale, target if self.is_last else None)
            self.stash.put(entry)
            self._t_f[n] = t_f
            if self.trace:
                self.records[n] = {"t_F": t_f, "F_version_buffer": fbuf}
            return out.detach(), (loss.detach() if loss is not None else None)

    def drop(self, i: int) -> None:
        """Mark micro-batch i so that its backward contributes nothing (skipped loss)."""
        for e in self.stash.entries():
            if e.i == i:
                e.dropped = True

    # ------------------------------------------------------------------ backward

    def backward(self, i: int, n: int, grad: Any) -> Any:
        """B(i): accumulates weight gradients; returns the gradient for the previous stage
        (None at stage 0, DROPPED when the micro-batch was skipped)."""
        with _label(f"stage{self.index}/B", n), action_context(self.index, n, "B"):
            entry = self.stash.pop(i)
            t_b = self.updates
            if self.trace:
                self.records.setdefault(n, {})["t_B"] = t_b
            if entry.dropped or grad is DROPPED:
                self.store.release(entry.fbuf, i)
                self.pending += 1
                self.pending_mbs.append(n)
                return DROPPED if self.index > 0 else None
            bk = self.policy.backward_kind
            release: list[int] = [entry.fbuf]
            if self.recompute:
                if bk == "same":
                    bbuf = entry.fbuf
                elif bk == "live":
                    bbuf = LIVE
                else:
                    bbuf = self.store.slot_with(self.policy.backward_values(self, i))
                    self.store.pin(bbuf, i)
                    release.append(bbuf)
            else:
                bbuf = entry.fbuf
                if bk == "live" and bbuf != LIVE:
                    self.store.copy_live_into(bbuf)
                elif bk == "values":
                    self.store.write(bbuf, self.policy.backward_values(self, i))
            self.peak_versions = max(self.peak_versions, self.store.versions_held(self.updates))
            with self.store.use(bbuf):
                if self.recompute:
                    xin = entry.x.detach().requires_grad_(
                        self.index > 0 and entry.x.is_floating_point()
                    )
                    cpu_rng, dev, dev_rng = entry.rng
                    with torch.random.fork_rng(devices=[] if dev is None else [dev]), torch.enable_grad():
                        torch.set_rng_state(cpu_rng)
                        if dev is not None:
                            torch.cuda.set_rng_state(dev_rng, dev)
                        out = self.module(xin)
                        if self.is_last:
                            out = self.loss_fn(out, entry.target) * entry.scale
                else:
                    xin = entry.x
                    out = entry.out
                if out.requires_grad:
                    torch.autograd.backward(out, None if self.is_last else grad)
            for slot in release:
                self.store.release(slot, i)
            self.pending += 1
            self.pending_weight += entry.scale
            self.pending_grads = True
            self.pending_mbs.append(n)
            if self.index == 0 or not xin.requires_grad:
                return None
            return xin.grad if xin.grad is not None else torch.zeros_like(xin)

    # ------------------------------------------------------------------ update

    def update(self, expected_weight: float | None = 1.0) -> None:
        """U: apply the accumulated gradient (mean over the coalesced samples) and advance t.

        Gradients were accumulated with each micro-batch's loss scaled so that a full group
        sums to the mean loss; a partial group (flush) or one with skipped micro-batches is
        renormalised by the weight that actually arrived, so no gradient is silently
        dropped or double counted."""
        with _label(f"stage{self.index}/U", self.updates):
            if isinstance(self.policy, DoubleBuffered):
                # the next mini-batch's forwards read the version this update replaces: keep it
                # (one of 2BW's two buffers); older versions are read by no future forward.
                self._unhold_older(self.updates)
                slot = self.store.find_version(self.updates)
                if slot is None:
                    slot = self.store.snapshot(self.updates)
                self.store.hold(slot, "2bw")
            for mp, sp in zip(self.store.params, self.shadow, strict=False):
                sp.grad = mp.grad
                mp.grad = None
            if self.pending_grads:
                if self.grad_hook is not None:
                    self.grad_hook(self.shadow)
                w = self.pending_weight
                if expected_weight is not None and not math.isclose(
                    w, expected_weight, rel_tol=1e-9
                ):
                    with torch.no_grad():
                        for sp in self.shadow:
                            if sp.grad is not None:
                                sp.grad.mul_(expected_weight / w)
                self.bridge.step()
                if self.scheduler is not None:
                    self.scheduler.step()
            for sp in self.shadow:
                sp.grad = None
            for n in self.pending_mbs:
                d = self.updates - self._t_f.pop(n, self.updates)
                self.delay_counts[d] = self.delay_counts.get(d, 0) + 1
                if self.trace:
                    self.records.setdefault(n, {})["update"] = self.updates
            self.updates += 1
            self.pending = 0
            self.pending_weight = 0.0
            self.pending_grads = False
            self.pending_mbs = []

    def discard_gradients(self) -> None:
        """Forget accumulated gradients (a skipped or failed synchronous step)."""
        for mp in self.store.params:
            mp.grad = None
        for n in self.pending_mbs:
            self._t_f.pop(n, None)
        self.pending = 0
        self.pending_weight = 0.0
        self.pending_grads = False
        self.pending_mbs = []

    def reset_in_flight(self) -> None:
        """Drop stashed activations and weight slots (after a failed step or at a flush)."""
        self.stash.clear()
        self.store.clear_slots()
        self._t_f.clear()
