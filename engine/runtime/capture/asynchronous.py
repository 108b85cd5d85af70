"""Asynchronous windows captured as graphs (``Pipeline(cuda_graphs="program")`` with pb).

Why: an asynchronous pipeline's step is a window of ticks that repeats once the pipeline is
full; on a GPU at batch 1 its launches are the cost. Unlike a synchronous step it
carries work across windows -- activations saved for backwards that run one or two windows
later, mailboxes, earlier steps' targets -- and a graph reads the addresses its capture read.
So (docs/ALGORITHMS.md, "Capturing whole step programs"):

* **Learning.** A key (staging key, micro-batch sizes, every optimizer's launch key, the
  step's compiled program) first runs eagerly under a dispatch recorder that keeps each
  call's outputs (the captured window too: the references change autograd's in-place
  decisions, so all are recorded alike), with the host state fingerprinted after each window. Once the last
  windows make the same calls, every outside tensor they read is static or carried from a
  fixed call of a fixed earlier window, nothing reads the host and the host counters advance
  evenly (:func:`engine.runtime.capture.carry.plan_carry`, :func:`~engine.runtime.capture.carry.host_affine`),
  the next window is captured. A key that never settles runs eagerly with the plan's reason.
* **Staging.** The batch is copied into static buffers outside the window (one ``copy_`` per
  tensor leaf), and the window's first calls clone them: the clones are made inside the
  window, so a target read by the last stage a window or two later is carried like any
  activation.
* **Rings.** Every carried output of call ``p``, read up to ``D`` windows back, gets ``D``
  slots: the tensors the learning windows made (the capture read them at those addresses).
  Before each replay after the first the slots shift (slot d <- slot d-1, slot 1 <- the
  capture's own output of ``p``), itself a small captured graph. Shifting *before* a
  replay keeps the host right between replays: every object it holds names the value it
  named after the captured window, one window later.
* **Host.** A replay runs no Python: the host difference of one window
  (:class:`engine.runtime.capture.host_shift.HostShift`) is added after each replay.
* **Leaving.** Anything else that touches the executor (an eager window, ``flush()``,
  ``load_state_dict``) leaves its state elsewhere than the ring assumes: the graph is
  dropped (checked at each step: the stash entries the capture left, and the step counters
  the shifts produced) and the key learns again.

Accepted: local asynchronous schedules whose windows repeat every step (pb with any
mitigation) with ``on_nonfinite="skip_update"``. PipeDream's and 2BW's version buffers
alternate between windows (a cycle of two graphs, not built): refused at build. Eager with
the reason: any window that reads the host or carries in-place writes, and a stage's LR
scheduler of a float lr. A scheduler of Tensor lrs is fed from static slots filled before
each window (:mod:`engine.runtime.capture.lr_feed`): the window copies its values in, never runs it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from engine.runtime.stage import labels
from engine.runtime.capture.carry import CarryPlan, fingerprint, host_affine, plan_carry, ring_depths
from engine.runtime.capture.optimizer_graphs import GraphBackend, launch_key
from engine.runtime.capture.host_shift import HostShift
from engine.runtime.capture.lr_feed import LrFeed, feed_refusal, make_feeds
from engine.runtime.exec.result import StepResult
from engine.runtime.capture.staging import Staging, staging_key

if TYPE_CHECKING:
    from engine.runtime.exec.executor import Executor

__all__ = ["AsyncCapture", "SideStreamGraphs"]

#: the CPU reference optimizer's host read of found_inf (the fused CUDA kernels read it on
#: the device); tolerated only with stages on the CPU (test backends)
REFERENCE_SKIP = "engine/optim/functional.py:_skip"
#: windows recorded before a capture (ring depth 2 + the window compared + its predecessor)
LEARN = 5
#: windows of one key without a capturable plan before it runs eagerly for good
GIVE_UP = 16
#: learning windows in a row with a new key each (an LR schedule changing lr, a launch
#: argument of the fused kernels, at every update) before PAUSE plain eager steps
CHANGING, PAUSE = 6, 64


def _keeper() -> Any:
    """A dispatch recorder that also keeps every call's fresh outputs: the ring's slots are
    such tensors. The learnt windows and the captured one are all recorded so, because the
    references change autograd's in-place decisions (the calls): the graph replays what the
    learnt windows promised (values equal eager's either way)."""
    from engine.runtime.capture.dispatch_trace import KeepingRecorder

    return KeepingRecorder()


class SideStreamGraphs:
    """The CUDA backend of asynchronous windows: every window -- learnt eagerly, captured or
    replayed -- runs on one side stream, and the graphs are captured on it. Why: autograd runs
    a backward's kernels on the stream its forward ran on, and a pb window runs backwards of
    forwards from earlier windows; were those forwards on the caller's (default) stream, the
    captured window's backwards would launch there while another stream captures, which CUDA
    refuses. The side stream waits for the caller's stream when a step starts (the batch,
    weights the caller wrote) and the caller's stream waits for it when the step ends."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            step()
        return graph.replay  # (the bound method keeps the graph alive)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)


class _Window:
    """One captured window: its replay, its ring, its host shift and its loss."""

    def __init__(self, key: Hashable, replay: Callable[[], None], ring: list[tuple[list[Tensor], Tensor]],
                 shift: HostShift, loss: Tensor | None, staging: Staging, plan: CarryPlan) -> None:
        self.key = key
        self.replay = replay
        self.ring = ring  # (slots: 1, 2, ... windows back; the capture's own output)
        self.shift = shift
        self.loss = loss
        self.staging = staging
        self.plan = plan
        self.rotate: Callable[[], None] | None = None
        self.token: Hashable = None
        self.lr_counts: dict[int, int] = {}  # scheduler steps per stage in the window


class AsyncCapture:
    """Runs a local asynchronous pipeline's steps eagerly (learning), captured or replayed
    (module docstring); ``stats()`` is ``Pipeline.stats()["capture"]``."""

    def __init__(self, ex: Executor, backend: GraphBackend | None = None) -> None:
        self.ex = ex
        self.backend: Any = backend or SideStreamGraphs()
        self.runs_at_capture = bool(getattr(self.backend, "runs_at_capture", False))
        self.cpu = all(p.device.type == "cpu" for st in ex.stages for p in st.store.params)
        self.counts = {"captures": 0, "replays": 0, "eager": 0, "learning": 0, "dropped": 0}
        self.reason: str | None = None
        self._staging: OrderedDict[Hashable, Staging] = OrderedDict()
        self._learn: list[tuple[Hashable, Any, Any]] = []  # (key, keeper, fingerprint)
        self._learned: OrderedDict[Hashable, int] = OrderedDict()  # windows learnt per key
        self._refused: OrderedDict[Hashable, str] = OrderedDict()
        self._window: _Window | None = None
        self._plan: CarryPlan | None = None
        self._changes = 0  # learning windows in a row whose key differed from the last one's
        self._pause = 0  # plain eager steps left before learning again
        self._feeds: dict[int, LrFeed] | None = None  # LR schedulers' slots (lr_feed.py)
        for st in ex.stages:
            if st.bridge is not None and st.bridge.skip is None:
                st.bridge.enable_skip_flags()

    # ------------------------------------------------------------------ one step

    def run_step(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        """One asynchronous step; a Ctrl-C during it is raised once the step is complete (a
        replay cannot stop halfway, so neither does an eager window of this mode)."""
        ex = self.ex
        running = getattr(self.backend, "running", None)
        with ex.interrupts.deferred(), (running() if running is not None else contextlib.nullcontext()):
            result = self._step(xs, targets, sizes)
        ex.interrupts.check()
        return result

    def _key(self, skey: Hashable, sizes: list[int]) -> Hashable | str:
        ex = self.ex
        if labels.profiling():
            return "a profiler is recording (the step's labels need an eager step)"
        if ex.action_hook is not None:
            return "an action hook is set (a replay would not call it)"
        if ex.log is not None or ex.cuda_events is not None:
            return "the executor is logging actions or timing events (host work at every action)"
        if ex.tail is not None:
            return "an interrupted step's actions are pending (they run eagerly first)"
        for st in ex.stages:
            why = feed_refusal(st)
            if why is not None:
                return why
        if self._feeds is None:  # schedulers of Tensor lrs: fed from slots, outside the window
            self._feeds = make_feeds(ex.stages)
            for st in ex.stages:
                st.lr_feed = self._feeds.get(st.index)
        opts = []
        for st in ex.stages:
            if st.bridge is None:
                continue
            k = launch_key(st.bridge.opt, (st.bridge.skip.found_inf.data_ptr(),), reference_ok=self.cpu)
            if isinstance(k, str):
                return f"stage {st.index}: {k}"
            opts.append(k)
        prog = ex.compiler.step(ex.j if ex.active else 0)
        return (skey, tuple(sizes), tuple(opts), id(prog))

    def _step(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        skey = staging_key(xs, targets)
        if isinstance(skey, str):
            return self._eager(xs, targets, sizes, skey)
        staging = self._staging.get(skey)
        if staging is None:
            staging = self._staging[skey] = Staging(xs, targets)
            while len(self._staging) > 4:
                self._staging.popitem(last=False)
        self._staging.move_to_end(skey)
        sx, sy = staging.stage(xs, targets)
        key = self._key(skey, sizes)
        w = self._window
        if w is not None and (isinstance(key, str) or key != w.key or w.token != self._token()):
            self._drop("left the replay path (" + (key if isinstance(key, str) else
                       "another key" if key != w.key else
                       "the executor moved: an eager step, flush() or load_state_dict") + ")")
            w = None
        if isinstance(key, str):
            return self._eager(sx, sy, sizes, key)
        if w is not None:
            return self._replay(w)
        if key in self._refused:
            return self._eager(sx, sy, sizes, self._refused[key])
        if self._pause > 0:  # keys that change every step: plain eager steps for a while
            self._pause -= 1
            return self._eager(sx, sy, sizes, self.paused)
        if self._plan is not None and self._learn and self._learn[-1][0] == key:
            return self._capture(key, sx, sy, sizes, staging)
        return self._learn_window(key, sx, sy, sizes)

    def _run(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        """The window: clone the staged batch (so it is made inside), run the step."""
        ex = self.ex
        cx = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, xs)
        cy = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, targets)
        ints = ex.interrupts
        ints.check = lambda: None  # type: ignore[method-assign]
        try:
            result = ex.run_step(cx, cy, sizes)
            ex.streams.join()  # stage streams: the window ends joined to the caller's stream
            return result
        finally:
            del ints.check

    def _feeds_before(self, exact: dict[int, int] | None = None) -> None:
        """Fill the LR schedulers' slots for the coming window (outside it): as many steps
        as the last window took, or ``exact``'s counts (a replay)."""
        for i, f in (self._feeds or {}).items():
            f.prepare(f.last if exact is None else exact[i], exact=exact is not None)

    def _feeds_after(self, replayed: bool = False) -> None:
        for f in (self._feeds or {}).values():
            if replayed:
                f.replayed()
            else:
                f.finish()

    def _eager(self, xs: list[Any], targets: list[Any], sizes: list[int], reason: str) -> StepResult:
        self.counts["eager"] += 1
        self.reason = reason
        self._learn.clear()
        self._plan = None
        self._feeds_before()
        try:
            return self._run(xs, targets, sizes)
        finally:
            self._feeds_after()

    def _learn_window(self, key: Hashable, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        if self._learn and self._learn[-1][0] != key:
            self._learn.clear()
            self._changes += 1
            if self._changes >= CHANGING:
                # (learning records every call: not a cost to pay at every step for nothing)
                self._changes, self._pause = 0, PAUSE
                return self._eager(xs, targets, sizes, self.paused)
        elif self._learn:
            self._changes = 0
        keeper = _keeper()
        self._feeds_before()
        try:
            with keeper:
                result = self._run(xs, targets, sizes)
        finally:
            self._feeds_after()
        self._learn.append((key, keeper, fingerprint(self.ex)))
        del self._learn[:-LEARN]
        self.counts["learning"] += 1
        n = self._learned[key] = self._learned.get(key, 0) + 1
        self._learned.move_to_end(key)
        while len(self._learned) > 64:  # (a schedule program's early steps are keys of their own)
            self._learned.popitem(last=False)
        self.reason = "learning the window (it runs eagerly until its plan holds)"
        if len(self._learn) == LEARN:
            plan, why = self._plan_of([k for _, k, _ in self._learn], [f for _, _, f in self._learn])
            if why is None:
                self._plan = plan
            elif n >= GIVE_UP:
                self._refuse(key, f"not captured: {why}")
        return result

    def _plan_of(self, keepers: list[Any], prints: list[Any]) -> tuple[CarryPlan, str | None]:
        plan = plan_carry(keepers, tolerated=lambda op: self.cpu and op.where == REFERENCE_SKIP)
        if plan.host_reads:
            return plan, f"the window reads the host ({plan.host_reads[0]})"
        if plan.problems:
            return plan, plan.problems[0]
        if plan.staged:
            return plan, "the window reads the user's batch directly"
        _, host = host_affine(*prints[-3:], path="executor")
        if host:
            return plan, f"host state does not advance evenly ({host[0]})"
        return plan, None

    def _capture(self, key: Hashable, xs: list[Any], targets: list[Any], sizes: list[int],
                 staging: Staging) -> StepResult:
        ex = self.ex
        plan = self._plan
        assert plan is not None
        self._plan = None
        depths = ring_depths(plan)
        keepers = [k for _, k, _ in self._learn]
        ring_slots = {pk: [keepers[-d].tensor(pk) for d in range(1, depth + 1)] for pk, depth in depths.items()}
        keeper = _keeper()
        box: dict[str, StepResult] = {}

        def window() -> None:
            with keeper:
                box["result"] = self._run(xs, targets, sizes)

        before = self._learn[-1][2]
        self._forget_events()
        self._feeds_before()
        try:
            replay = self.backend.capture(window)
        finally:
            self._feeds_after()  # (no device work: a steady window takes every slot)
        after = fingerprint(ex)
        self.counts["captures"] += 1
        self.reason = None
        if not self.runs_at_capture:
            replay()  # the capture ran nothing on the device; slots still hold their values
        self._settle_streams()
        result = box["result"]
        again, why = self._plan_of([*keepers[1:], keeper], [f for _, _, f in self._learn[1:]] + [after])
        learnt = [(k, f) for k, f in zip(keepers, (f for _, _, f in self._learn), strict=True)]
        self._learn.clear()
        del learnt
        outs = {pk: keeper.tensor(pk) for pk in depths}
        if why is not None or ring_depths(again) != depths or any(t is None for t in outs.values()):
            self._refuse(key, f"not captured: the captured window differs from the learnt ones "
                              f"({why or 'another ring'})")
            return result
        ring = [(ring_slots[pk], outs[pk]) for pk in sorted(depths)]  # type: ignore[misc]
        loss = result.loss
        w = _Window(key, replay, ring, HostShift(before, after), loss, staging, again)
        w.token = self._token()
        w.lr_counts = {i: f.last for i, f in (self._feeds or {}).items()}
        self._window = w
        return StepResult(None if loss is None else loss.clone())

    def _rotate(self, w: _Window) -> None:
        """Shift every ring by one window (slot d <- slot d-1, slot 1 <- the output)."""
        # through .data: autograd's version counters stay as the capture left them (a
        # replay bumps none; a saved slot bumped here would fail a later eager backward)
        for slots, out in w.ring:
            for d in range(len(slots) - 1, 0, -1):
                slots[d].data.copy_(slots[d - 1])
            slots[0].data.copy_(out)

    def _replay(self, w: _Window) -> StepResult:
        self._feeds_before(w.lr_counts)
        if w.rotate is None:
            w.rotate = self.backend.capture(lambda: self._rotate(w))
            if not self.runs_at_capture:
                w.rotate()
        else:
            w.rotate()
        w.replay()
        self._feeds_after(replayed=True)
        self._settle_streams()
        w.shift.apply(self.ex)
        w.token = self._token()
        self.counts["replays"] += 1
        return StepResult(None if w.loss is None else w.loss.clone())

    def _settle_streams(self) -> None:
        """With stage streams: the mailboxes' events were recorded while capturing (a stream
        outside the capture may not wait for them) and the replay ran on the caller's stream;
        so drop those events and make every stage stream wait for the caller instead -- a
        later eager action (a ``flush()``) then reads the replay's outputs in order."""
        if self._forget_events():
            self.ex.streams.wait_caller()

    def _forget_events(self) -> bool:
        """Drop the events of the activations and gradients in the mailboxes (True with stage
        streams). Before a capture: they were recorded by the eager window before it, and a
        captured stream may not wait for uncaptured work (CUDA invalidates the capture:
        "dependency created on uncaptured work in another stream"); that window ended joined to the caller's stream, and the capture's
        stage streams fork from it, so the work they marked is ordered before anyway."""
        ex = self.ex
        if not ex.streams.separate:
            return False
        for box in (ex.acts, ex.grads):
            for k, (v, ev) in list(box.items()):
                if ev is not None:
                    box[k] = (v, None)
        return True

    def _token(self) -> Hashable:
        """What the ring assumes of the executor: the stash entries the capture left (the
        same objects after every replay) and the counters the shifts produced."""
        ex = self.ex
        return (ex.steps, ex.j, ex.n_base, ex.active,
                tuple(id(e) for st in ex.stages for e in st.stash.entries()))

    paused = ("the capture key changed at every step (e.g. an LR schedule: lr is a launch "
              "argument of engine.optim's fused kernels): plain eager steps for a while")

    def _refuse(self, key: Hashable, why: str) -> None:
        self._refused[key] = self.reason = why
        while len(self._refused) > 64:
            self._refused.popitem(last=False)
        self._learn.clear()

    def _drop(self, why: str) -> None:
        self._window = None
        self.counts["dropped"] += 1
        self.reason = why

    # ------------------------------------------------------------------ facts

    def fold(self) -> None:
        """The device counts of "skip_update" are the executor's (``fold_flags``)."""

    def stats(self) -> dict[str, Any]:
        w = self._window
        ring = None if w is None else {"depth": w.plan.depth, "slots": len(w.ring),
                                       "bytes": sum(o.numel() * o.element_size() * len(s) for s, o in w.ring)}
        return {"mode": "program", "window": "asynchronous step", **self.counts,
                "graphs": 0 if w is None else 1, "ring": ring,
                "staging_buffers": len(self._staging), "last_eager_reason": self.reason}
