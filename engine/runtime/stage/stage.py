"""One pipeline stage: its module, weight store, optimizer, activation stash and the F/B/U
actions that run on it.

How a forward and a backward read exactly the weights the policy names, without copies:

* The policy names a buffer of the stage's :class:`~engine.runtime.stage.weight_store.WeightStore`
  (the live weights, a version kept for this micro-batch, or the transient holding a
  prediction or PipeMare's correction); the stage runs the module under ``store.use(buffer)``,
  which points every parameter's ``.data`` at that buffer's views for the action.
* Without recomputation the backward replays the graph the forward saved. Views of the
  weights that builtin ops saved keep the storage the forward ran on. That storage is either
  what the backward must read anyway (synchronous schedules, pb; a stashed version, which the
  store *retires* instead of overwriting when the optimizer steps), or, for the mitigations
  whose backward reads other values (LWP, PipeMare T2, SpecTrain with s_B = 0), autograd's
  saved weights are re-pointed at the backward's buffer by saved-tensor hooks
  (:mod:`~engine.runtime.stage.saved_weights`). Either way one live version plus one transient.
* With recomputation (``checkpoint`` "always", or "except_last" on every stage but the last)
  the forward runs under ``torch.utils.checkpoint`` (non-reentrant, RNG preserved), which
  keeps no activations and re-runs the stage function when the backward unpacks them: under
  ``use(backward buffer)`` the recomputed forward reads W_B, so activations and weights both
  come from W_B. For stashing and synchronous schedules W_B = W_F and results equal no
  recomputation; for the live-weight methods it is the reading PipeMare's T2 estimates.

Gradients accumulate straight into the arena's flat gradient buffers (the parameters' ``.grad``
are views of them for the stage's whole life); an update steps the optimizer over them and
zeroes them. Which parameters received a gradient in the current group is tracked with
post-accumulate hooks, so an unused parameter is skipped by the optimizer exactly as torch
skips a parameter whose ``.grad`` is None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.profiler import record_function

from engine.errors import PipelineInputError
from engine.runtime.stage import fresh_grads, labels, trees
from engine.runtime.stage import trace as _trace
from engine.runtime.precision import autocast_context
from engine.runtime.stage.inputs import checked_loss
from engine.runtime.stage.optim_bridge import OptimizerBridge
from engine.runtime.stage.policy import LIVE, PINNED, Transient, WeightPolicy
from engine.runtime.stage.saved_weights import SavedWeights
from engine.runtime.stage.stage_update import StageUpdates
from engine.runtime.stage.stash import DROPPED, ActivationStash, StashEntry, _Dropped
from engine.runtime.stage.weight_store import LIVE as LIVE_BUFFER
from engine.runtime.stage.weight_store import WeightStore

__all__ = ["Stage", "DROPPED", "BackwardJob"]

_NULL = contextlib.nullcontext()

#: stages with at most this many weight bytes make a backward read the live weights by
#: copying them into the forward's transient (one memcpy per backward) rather than through
#: saved-tensor hooks (a Python call per saved tensor, some 16 per residual block): below
#: about 1 MiB the copy is the cheaper of the two (docs/design-notes.md)
REBASE_MAX_BYTES = 1 << 20


class BackwardJob:
    """One stage's backward of one micro-batch, between :meth:`Stage.begin_backward` and
    :meth:`Stage.finish_backward` (several can share one autograd call)."""

    __slots__ = ("stage", "i", "n", "entry", "grad", "buf")

    def __init__(self, stage: Stage, i: int, n: int, entry: StashEntry, grad: Any, buf: int) -> None:
        self.stage = stage
        self.i = i
        self.n = n
        self.entry = entry
        self.grad = grad
        self.buf = buf


class Stage(StageUpdates):
    """Stage ``index`` of ``num_stages``: runs F(i), B(i) and U on its module and optimizer."""

    def __init__(
        self,
        index: int,
        num_stages: int,
        module: nn.Module,
        store: WeightStore,
        bridge: OptimizerBridge,
        policy: WeightPolicy,
        recompute: bool,
        loss_fn: Callable[[Tensor, Any], Tensor] | None,
        trace: bool = False,
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.module = module
        self.store = store
        self.bridge = bridge
        self.policy = policy
        self.recompute = recompute
        self.loss_fn = loss_fn
        self.is_last = index == num_stages - 1
        #: set by the build when used: the LR scheduler and, with cuda_graphs="program", its
        #: steps owed until after the window (capture.py) or fed from static slots (lr_feed.py);
        #: grad_hook (the flat gradients before each optimizer step: gloo/NCCL's data-parallel
        #: all-reduce); clipper (clipping.py); autocast (dtype, device type) and loss_scaler
        #: (precision.py); offload (offload.py)
        self.scheduler: Any = None
        self.defer_scheduler, self.scheduler_owed, self.lr_feed = False, 0, None
        self.grad_hook: Callable[[list[Tensor]], None] | None = None
        self.clipper: Any = None
        self.autocast: tuple[torch.dtype, str] | None = None
        self.loss_scaler: Any = None
        self.offload: Any = None
        #: nanoseconds spent in this stage's forwards, backwards and updates (throughput.py)
        self.busy_ns = 0
        self._prepared = False  # prepare_grads ran for the pending update
        self.stash = ActivationStash()
        self.updates = 0  # t: updates applied so far
        self.segment_updates = 0  # t when the current segment started (2BW's origin)
        self.forwards = 0  # forwards run in the current segment
        self.pending = 0  # backwards accumulated since the last update (dropped ones too)
        self.pending_weight = 0.0  # sum of their loss scales (1.0 = a full group)
        self.pending_mbs: list[int] = []
        self.delay_counts: dict[int, int] = {}
        self.skipped_updates = 0
        self.trace = trace
        self.records: dict[int, dict[str, Any]] = {}
        #: micro-batch id -> the weight version its forward read, until its update counts it
        #: (measured delays; saved with an unflushed pipeline's state, engine.runtime.state.inflight)
        self.versions_read: dict[int, int] = {}
        #: chained (synchronous steps in one process): stage inputs keep the previous stage's
        #: graph and the last stage's backward runs every stage's (set by the executor)
        self.chain = False
        #: B: input gradient only, W(i) the rest, for split_only's micro-batches (None: all); by the executor
        self.split, self.split_only = False, cast("frozenset[int] | None", None)
        self._deferred: dict[int, BackwardJob] = {}  # Bs awaiting their W
        remap = policy.remaps_saved_weights and not recompute and not self._all_live()
        weight_bytes = sum(f.numel() * f.element_size() for f in store.live_flats())
        #: rebase instead of remapping (see _rebase_transient): small stages whose backward
        #: reads the live weights (LWP, SpecTrain with s_B = 0)
        self._rebase = remap and policy.backward(self) is LIVE and weight_bytes <= REBASE_MAX_BYTES
        self._saved = SavedWeights(store) if remap and not self._rebase else None
        self._transient_fill = self._make_transient_fill()
        #: buffers a forward updates in place (BatchNorm's running statistics and batch count)
        #: (and a DeferredBatchNorm's accumulators)
        self._running_stats = [
            t
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            for t in m.buffers(recurse=False)
        ]

    def _all_live(self) -> bool:
        """Whether forward and backward both read the live weights at this stage (a
        mitigation with nothing to do, e.g. at the last stage, whose delay is 0)."""
        reqs = [self.policy.forward(self), self.policy.backward(self)]
        return all(r is LIVE or (isinstance(r, Transient) and self._trivial(r)) for r in reqs)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.bridge.opt

    # ------------------------------------------------------------------ weights

    def _make_transient_fill(self) -> dict[str, Callable[[Transient], Callable[[int], None]]]:
        bridge, store = self.bridge, self.store

        def predict(req: Transient) -> Callable[[int], None]:
            return lambda buf: bridge.write_prediction(req.horizon, store, buf)

        def correct(req: Transient) -> Callable[[int], None]:
            return lambda buf: bridge.write_backward_weights(store, buf)

        return {"predict": predict, "correct": correct}

    def _transient(self, req: Transient) -> int:
        """The transient buffer holding ``req``'s values now; the live buffer itself when
        they equal the live weights (a zero horizon, no delay to correct for)."""
        if self._trivial(req):
            return LIVE_BUFFER
        key = req.key()
        return self.store.transient(key, self.updates, self._transient_fill[req.kind](req))

    def _trivial(self, req: Transient) -> bool:
        bridge = self.bridge
        if bridge is None:
            return True
        if req.kind == "correct":
            return bridge.delay == 0
        horizon = req.horizon if req.horizon is not None else bridge.default_horizon()
        return horizon == 0

    # ------------------------------------------------------------------ forward

    def forward(
        self, i: int, n: int, x: Any, target: Any, scale: float
    ) -> tuple[Any, Tensor | None]:
        """F(i): returns (output for the next stage, detached unscaled loss at the last stage)."""
        label = record_function(f"stage{self.index}/F{n}") if labels.profiling() else _NULL
        tl = _trace.ACTIVE
        t0 = perf_counter_ns()
        with label:
            labels.CURRENT = (self.index, n, "F")
            try:
                return self._forward(i, n, x, target, scale)
            finally:
                labels.CURRENT = None
                self.busy_ns += perf_counter_ns() - t0
                if tl is not None:
                    tl.add(self.index, f"stage{self.index}/F{n}", "forward", t0, {
                        "micro_batch": n, "version_read": self.versions_read.get(n), "live_version": self.updates})

    def _forward(
        self, i: int, n: int, x: Any, target: Any, scale: float
    ) -> tuple[Any, Tensor | None]:
        store = self.store
        policy = self.policy
        t_f = policy.version_read(self)
        if x is DROPPED:
            self.stash.put(StashEntry(i, None, None, None, t_f, scale, dropped=True))
            self.forwards += 1
            self.versions_read[n] = t_f
            return DROPPED, None
        want = policy.forward(self)
        pin: Any = None
        if want is LIVE:
            buf = LIVE_BUFFER
        elif isinstance(want, Transient):
            buf = self._transient(want)
            if policy.pins_forward:  # SpecTrain's reuse: B reads exactly what F read
                pin = store.pin_transient(i) if buf != LIVE_BUFFER else store.pin_version(self.updates, i)
        else:
            pin = store.pin_version(want, i)
            buf = store.resolve(pin)
        if self.chain:
            xin = x  # chained: the previous stage's output, graph attached
        elif isinstance(x, Tensor):
            # a gradient flows back where the producer's output required one (trees.py)
            xin = x.detach().requires_grad_(self.index > 0 and x.requires_grad)
        else:
            xin = trees.stage_input(x, self.index > 0)
        loss: Tensor | None = None
        ok = False
        if self._rebase and buf != LIVE_BUFFER:
            store.point(buf)  # kept through the backward and later forwards until settle()
        try:
            with store.use(buf) if buf != store.active else _NULL:
                if self._saved is not None and not self.recompute:
                    with self._saved.packing(buf):
                        out = self._run(xin, target)
                elif self.offload is not None and not self.recompute:
                    with self.offload.saving():  # saved activations to host memory (offload.py)
                        out = self._run(xin, target)
                else:
                    out = self._call(xin, target)
            loss = out if self.is_last else None
            keep = self.kept(out, scale)
            ok = True
        finally:
            if not ok and pin is not None:
                store.release(pin, i)
        self.stash.put(StashEntry(i, xin, keep, pin, t_f, scale, buf=buf, target=target))
        self.forwards += 1
        self.versions_read[n] = t_f
        if self.trace:
            self.records[n] = {"t_F": t_f}
        assert loss is None or isinstance(loss, Tensor)
        if self.is_last:
            return None, loss.detach() if loss is not None else None
        # passed on with its graph: the next stage detaches it (and a tensor's requires_grad
        # there says whether a gradient comes back), so one detach per hand-off
        return out, None

    def _call(self, xin: Any, target: Any) -> Any:
        """The stage function on ``xin``: under ``torch.utils.checkpoint`` when recomputing."""
        if self.recompute:
            return torch.utils.checkpoint.checkpoint(
                self._recomputable(), xin, target, use_reentrant=False, preserve_rng_state=True
            )
        return self._run(xin, target)

    def rerun_forward(self, i: int, xin: Any, target: Any, pin: Any, t_f: int, scale: float) -> None:
        """Re-run F(i) of a resumed micro-batch (engine.runtime.state.inflight) on the buffer it
        pinned (live when none: its stage recomputes in the backward); stash it as F(i) did."""
        buf = self.store.resolve(pin) if pin is not None else LIVE_BUFFER
        with self.store.use(buf):
            out = self._call(xin, target)
        self.stash.put(StashEntry(i, xin, self.kept(out, scale), pin, t_f, scale, buf=buf, target=target))

    @property
    def remaps_saved(self) -> bool:
        """Whether the backward re-points the weights the forward saved (saved-tensor hooks)."""
        return self._saved is not None

    def kept(self, out: Any, scale: float) -> Any:
        """What the stash keeps of a forward's output for its backward: the scaled loss on
        the last stage; else the output, or of a tree only the leaves that require grad."""
        if self.is_last:
            root = out if scale == 1.0 else out * scale  # x * 1.0 == x: save the launch
            scaler = self.loss_scaler  # (asynchronous float16: scaled at the backward, precision.py)
            return root if scaler is None or not scaler.synchronous else scaler.scaled(root)
        return out if isinstance(out, Tensor) else trees.grad_roots(out)

    def _recomputable(self) -> Callable[[Any, Any], Tensor]:
        """The stage function for ``torch.utils.checkpoint``: its first call is the forward;
        later calls are the recomputation inside the backward, which must not update
        BatchNorm's running statistics a second time (they are put back afterwards; the
        recomputation may also stop early, by an exception, once it has what it needs)."""
        stats = self._running_stats
        if not stats:
            return self._run
        calls = 0

        def run(x: Any, target: Any) -> Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self._run(x, target)
            kept = [t.clone() for t in stats]
            try:
                return self._run(x, target)
            finally:
                with torch.no_grad():
                    for t, k in zip(stats, kept, strict=True):
                        t.copy_(k)

        return run

    def _run(self, x: Any, target: Any) -> Any:
        if self.autocast is not None:  # the forward and its recomputation alike (precision.py)
            with autocast_context(*self.autocast):
                return self._run_plain(x, target)
        return self._run_plain(x, target)

    def _run_plain(self, x: Any, target: Any) -> Any:
        out = self.module(x) if isinstance(x, Tensor) else trees.call(self.module, x)
        if self.is_last:
            return checked_loss(self.index, self.loss_fn, out, target)  # names the micro-batch
        if not isinstance(out, Tensor):
            problem = trees.check_output(out, f"stage {self.index}")
            if problem:
                raise PipelineInputError(problem)
        return out

    def drop_forward(self, i: int, n: int, scale: float) -> None:
        """Record F(i) as dropped (its forward raised): later actions on it are no-ops."""
        self.stash.put(
            StashEntry(i, None, None, None, self.policy.version_read(self), scale, dropped=True)
        )
        self.forwards += 1

    def drop(self, i: int) -> None:
        """Mark micro-batch i so that its backward contributes nothing (skipped loss)."""
        e = self.stash.get(i)
        if e is not None:
            e.dropped = True

    # ------------------------------------------------------------------ backward

    def backward(self, i: int, n: int, grad: Any) -> Any:
        """B(i): accumulates weight gradients into the flat buffers; returns the gradient for
        the previous stage (None at stage 0, DROPPED when the micro-batch was dropped)."""
        label = record_function(f"stage{self.index}/B{n}") if labels.profiling() else _NULL
        tl = _trace.ACTIVE
        t0 = perf_counter_ns()
        with label:
            labels.CURRENT = (self.index, n, "B")
            try:
                return self._backward(i, n, grad)
            finally:
                labels.CURRENT = None
                self.busy_ns += perf_counter_ns() - t0
                if tl is not None:
                    tl.add(self.index, f"stage{self.index}/B{n}", "backward", t0, {
                        "micro_batch": n, "forward_version": self.versions_read.get(n),
                        "live_version": self.updates})

    def _backward(self, i: int, n: int, grad: Any) -> Any:
        job = self.begin_backward(i, n, grad)
        if job is None or isinstance(job, _Dropped):
            return job
        if self.split and (self.split_only is None or i in self.split_only):  # input grad now, W later
            self.stash.put(job.entry)  # its activations live until W(i): the peak counts them
            self._deferred[i] = job
            try:
                self._split_backward(job, "input")
            except BaseException:
                self.stash.pop(self._deferred.pop(i).i)
                self.end_backward(job)
                raise
            return self.finish_backward(job)
        try:
            self.run_backward([job])
        finally:
            self.end_backward(job)
        return self.finish_backward(job)

    def begin_backward(self, i: int, n: int, grad: Any) -> BackwardJob | _Dropped | None:
        """B(i) up to the autograd call: bookkeeping and the buffer the backward must read.
        Returns the job to run (:meth:`run_backward`), DROPPED (pass it upstream) or None
        (nothing to run: stage 0 of a dropped micro-batch, or a chained stage whose backward
        runs inside the last stage's)."""
        entry = self.stash.pop(i)
        amp = self.loss_scaler
        if amp is not None and not amp.synchronous:  # float16, one scale per stage (precision.py)
            grad = amp.before_backward(self, i, grad, entry)
        if self.trace:
            self.records.setdefault(n, {})["t_B"] = self.updates
        self.pending += 1
        self.pending_mbs.append(n)
        if entry.dropped or grad is DROPPED:
            if entry.pin is not None:
                self.store.release(entry.pin, i)
            return DROPPED if self.index > 0 else None
        if entry.flag is not None and self.bridge is not None:  # on_nonfinite="skip_update"
            self.bridge.flag(entry.flag)
        if self.chain and not self.is_last:
            self.pending_weight += entry.scale  # ran in the last stage's backward
            return None
        want = self.policy.backward(self)
        if want is LIVE:
            buf = LIVE_BUFFER
            if self._rebase and entry.buf != LIVE_BUFFER:
                self._rebase_transient(entry.buf)
                buf = entry.buf  # now holding the live weights: no pointer switch
        elif want is PINNED:
            buf = self.store.resolve(entry.pin) if entry.pin is not None else LIVE_BUFFER
        else:
            assert isinstance(want, Transient)
            buf = self._transient(want)
        return BackwardJob(self, i, n, entry, grad, buf)

    def settle(self) -> None:
        """Point the parameters back at the live weights (the end of every executor run: in rebase
        mode they stay on the transient between actions, saving two pointer switches per forward)."""
        if self.store.active != LIVE_BUFFER:
            self.store.point(LIVE_BUFFER)

    def _rebase_transient(self, buf: int) -> None:
        """Make the forward's saved weight views read the live weights: copy live into the
        transient ``buf`` the forward ran on (autograd saved views of it) and mark the
        transient stale, so the next forward that wants a prediction recomputes it unless
        the next update writes it. Every micro-batch in flight saved views of this one
        buffer, and each one's backward is preceded by this copy, so each reads the live
        weights of its own backward: the hooks' result, with one memcpy instead of a Python
        call per saved tensor. The writes do not bump the parameters' version counters (the
        parameters only borrow the buffer's storage through ``.data``), so autograd's
        saved-tensor checks still hold."""
        store = self.store
        with torch.no_grad():
            for dst, src in zip(store.flats(buf), store.live_flats(), strict=True):
                dst.copy_(src)
        store.invalidate_transient()

    @staticmethod
    def _enter(job: BackwardJob, stack: contextlib.ExitStack) -> tuple[list[Tensor], list[Any]]:
        """``job``'s backward roots and output gradients, its weight buffer entered on ``stack``."""
        st = job.stage
        out = job.entry.out
        single = isinstance(out, Tensor)
        if single:
            if not out.requires_grad or (not st.is_last and job.grad is None):
                return [], []
        elif not out:  # dropped, or a tree none of whose leaves requires grad
            return [], []
        if job.buf != st.store.active:
            stack.enter_context(st.store.use(job.buf))
        if st._saved is not None:
            stack.enter_context(st._saved.unpacking(job.buf))
        if single:
            return [out], [None if st.is_last else job.grad]
        # a tree's leaves that require grad, one gradient each (trees.py)
        assert len(job.grad) == len(out), (len(job.grad), len(out))
        return list(out), list(job.grad)

    def run_backward(self, jobs: list[BackwardJob]) -> None:
        """One autograd call for ``jobs`` of *different* stages (disjoint parameters, so the
        result equals running them one by one), each under its own weight buffer."""
        roots: list[Tensor] = []
        grads: list[Any] = []
        with contextlib.ExitStack() as stack:
            for job in jobs:
                r, g = self._enter(job, stack)
                roots += r
                grads += g
            if roots:
                fresh_grads.backward(roots, grads, [job.stage.store.fresh for job in jobs])

    def _split_backward(self, job: BackwardJob, part: str) -> None:
        """Half of a backward split into B and W (zero-bubble schedules): "input" accumulates
        only the stage input's gradient and keeps the graph for "weight", which accumulates
        only the parameters' gradients and frees it: together, one whole backward."""
        if part == "input":
            inputs = [t for t in trees.tensors(job.entry.x) if t.requires_grad]
        else:
            inputs = [p for p in self.module.parameters() if p.requires_grad]
        with contextlib.ExitStack() as stack:
            roots, grads = self._enter(job, stack)
            if roots and inputs:
                fresh = [self.store.fresh] if part == "weight" else []
                fresh_grads.backward(roots, grads, fresh, inputs=inputs, retain_graph=part == "input")

    def backward_weight(self, i: int, n: int) -> None:
        """W(i): the weight gradient of micro-batch i, whose B(i) computed only the input
        gradient (nothing for a dropped micro-batch or one whose B failed)."""
        job = self._deferred.pop(i, None)
        if job is None:
            return
        self.stash.pop(i)
        tl = _trace.ACTIVE
        t0 = perf_counter_ns()
        with record_function(f"stage{self.index}/W{n}") if labels.profiling() else _NULL:
            labels.CURRENT = (self.index, n, "W")
            try:
                self._split_backward(job, "weight")
            finally:
                labels.CURRENT = None
                self.end_backward(job)
                self.busy_ns += perf_counter_ns() - t0
                if tl is not None:
                    tl.add(self.index, f"stage{self.index}/W{n}", "weight", t0,
                           {"micro_batch": n, "live_version": self.updates})

    def end_backward(self, job: BackwardJob) -> None:
        """Release what the job pinned (also when its backward raised)."""
        if job.entry.pin is not None:
            self.store.release(job.entry.pin, job.i)

    def finish_backward(self, job: BackwardJob) -> Any:
        """The gradient for the previous stage (None at stage 0)."""
        self.pending_weight += job.entry.scale
        xin = job.entry.x
        if self.chain or self.index == 0:
            return None
        gin = trees.input_gradient(xin)
        amp = self.loss_scaler
        if amp is not None and not amp.synchronous:  # checked, and sent with its scale
            amp.outgoing(self, job.i, gin)
        return gin

    def reset_in_flight(self) -> None:
        """Drop stashed activations and kept weight versions (rollback, end of a segment)."""
        self.stash.clear()
        self._deferred.clear()
        self.versions_read.clear()
        self.store.release_all()
