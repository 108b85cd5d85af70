"""Whole synchronous steps captured as one graph (``Pipeline(cuda_graphs="program")``).

Why: a synchronous step driven from Python launches each forward, backward and update one
at a time; on a GPU the host is the bottleneck. A CUDA graph of the whole step --
every stage's forwards, backwards and update -- replays it with one call. What capture
needs, this module arranges (docs/ALGORITHMS.md, "Capturing whole step programs"):

* the batch in static buffers (:mod:`engine.runtime.capture.staging`, one ``copy_`` per tensor leaf
  and micro-batch slot, outside the window);
* no host read inside the window: the non-finite loss check becomes a device count of
  non-finite losses that every stage's update consumes as ``found_inf`` (engine.optim skips
  the whole update on the device, as ``on_nonfinite="skip_update"`` does); ``"raise"`` and
  ``"skip"`` read the per-loss flags once, *after* the window, and undo the step's host
  bookkeeping (a ``"raise"`` also restores the RNG states and module buffers, as eager's
  rollback); ``"skip_update"`` reads nothing (its counts are folded by ``stats()``);
* weights, gradients and optimizer state already sit at fixed arena addresses.

Learning rates stay host numbers: engine.optim's fused kernels take ``lr`` as a launch
argument, not a device tensor, so a step's *capture key* holds every param group option
(:func:`engine.runtime.capture.optimizer_graphs.launch_key`) next to the staging key and the micro-batch
sizes. A new key runs eagerly once (the warm-up, watched for host reads), is captured when
it repeats and replayed from then on; at most ``cache`` graphs are kept (least recently used
dropped). So an LR schedule that changes ``lr`` at every step runs eagerly (the reason is
in ``stats()["capture"]``), one that changes it every k steps recaptures once per value.

A replay runs no Python, so the host bookkeeping a step does (update counts, delays, weight
versions, the executor's counters) is applied from the difference the captured step made
(:class:`_Host`). A stage's LR scheduler never steps inside a window: its updates owe the
steps, taken after the window (:func:`settle_schedulers`), so a Tensor lr's writes are
never recorded into a graph.

With ``cuda_streams=True`` each stage's actions are captured on its own stream, with the
executor's events as the graph's edges (one per hand-off; the window forks from the caller's
stream at its feed and joins back at its end): the stages become concurrent branches (the
fork-join is checked on CPU by engine.testing.stream_recorder; never run on a GPU).

Asynchronous schedules (pb) are :mod:`engine.runtime.capture.asynchronous`'s. Refused when the
pipeline is built: PipeDream and 2BW (their version buffers alternate: "these asynchronous
windows are not captured yet"), asynchronous schedules without ``on_nonfinite="skip_update"``,
gloo/NCCL transports, ``trace=True``, optimizers other than engine.optim's
SGD/Adam/AdamW/NAdam with fused steps, and stages off CUDA unless a test backend is
installed (:func:`use_backend`). Eager at run time, with the reason: a profiler recording,
an action hook, a batch leaf that requires grad, a key not seen before, an optimizer step
that cannot be replayed (its first step, a hidden gradient, ...), and a key whose warm-up
read the host.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.errors import PipelineConfigError
from engine.runtime.stage import labels
from engine.runtime.capture.asynchronous import AsyncCapture
from engine.runtime.capture.optimizer_graphs import CudaGraphBackend, GraphBackend, graph_refusal, launch_key
from engine.runtime.exec.result import StepResult
from engine.runtime.exec.rollback import RollbackPoint
from engine.runtime.capture.staging import Staging, staging_key

if TYPE_CHECKING:
    from engine.runtime.exec.executor import Executor
    from engine.runtime.stage.stage import Stage

__all__ = ["ASYNC_REASON", "ProgramCapture", "optimizer_refusal", "program_capture", "program_refusal",
           "refuse_program",
           "use_backend"]

ASYNC_REASON = "these asynchronous windows are not captured yet"
#: the host read of engine.optim's CPU reference path (``found_inf.item()``); the fused CUDA
#: kernels read found_inf on the device. Only exempt for stages on the CPU (test backends).
REFERENCE_SKIP = "engine/optim/functional.py:_skip"

_TEST_BACKEND: GraphBackend | None = None


@contextlib.contextmanager
def use_backend(backend: GraphBackend) -> Iterator[None]:
    """Build ``cuda_graphs="program"`` pipelines inside this block with ``backend`` instead of
    CUDA graphs (tests: a recording twin on the CPU). A backend whose ``reruns_host`` is True
    runs the window's Python at every replay; its host effects are then undone and the
    recorded difference applied, exactly as after a CUDA replay."""
    global _TEST_BACKEND
    old, _TEST_BACKEND = _TEST_BACKEND, backend
    try:
        yield
    finally:
        _TEST_BACKEND = old


def program_refusal(spec: Any, config: Any, features: Any = None) -> str | None:
    """Why ``cuda_graphs="program"`` cannot run this schedule and configuration (None: it
    can); checked before any module is built. The optimizers and devices are checked by
    :func:`optimizer_refusal` as each stage is built."""
    if not spec.synchronous and spec.weights != "live":
        return (f"cuda_graphs='program' with schedule={spec.name!r}: {ASYNC_REASON} (its "
                f"weight versions ({spec.weights}) alternate between buffers from one window to "
                "the next, which needs a cycle of two graphs and a host state consistent "
                "between them; not built); use pb, a synchronous schedule or "
                "cuda_graphs='optimizer'")
    if not spec.synchronous and config.on_nonfinite != "skip_update":
        return (f"cuda_graphs='program' with schedule={spec.name!r} and "
                f"on_nonfinite={config.on_nonfinite!r}: an asynchronous window would read every "
                "loss on the host; pass on_nonfinite='skip_update' (non-finite losses become "
                "device flags that skip their updates on the device)")
    if features is not None and getattr(features, "offload_activations", False):
        return ("cuda_graphs='program' with offload_activations=True: copies to host memory "
                "inside a captured step are not captured yet")
    if config.trace:
        return ("cuda_graphs='program' with trace=True: the trace records on the host at every "
                "action, which a replay would not do")
    return None


def refuse_program(spec: Any, config: Any, features: Any = None) -> None:
    """Raise PipelineConfigError with :func:`program_refusal`'s reason, if any (a no-op
    unless ``config.cuda_graphs == "program"``)."""
    why = program_refusal(spec, config, features) if config.cuda_graphs == "program" else None
    if why is not None:
        raise PipelineConfigError(why)


def optimizer_refusal(stage: int, opt: Any, device: torch.device, mode: Any) -> str | None:
    """Why stage ``stage``'s optimizer or device cannot be captured in ``mode`` ("optimizer"
    or True: :func:`engine.runtime.capture.optimizer_graphs.graph_refusal`; "program": the same optimizers --
    their fused steps take found_inf on the device -- on CUDA, or on the CPU while a test
    backend is installed)."""
    if mode != "program":
        return graph_refusal(stage, opt, device)
    if _TEST_BACKEND is not None and device.type == "cpu":
        device = torch.device("cuda")  # a recording twin stands in for the GPU
    reason = graph_refusal(stage, opt, device)
    if reason is None:
        return None
    return reason.replace("cuda_graphs=True captures each stage's optimizer step",
                          "cuda_graphs='program' captures whole steps").replace(
        "cuda_graphs captures", "cuda_graphs='program' captures")


def _no_check() -> None:
    """Interrupts.check inside a window: Ctrl-C waits for the step's end."""


def _scalars(ex: Executor) -> dict[str, Any]:
    """Every number, bool and string the host keeps of a step: executor, stages, weight
    stores, optimizer bridges and param groups (what a twin replay checks)."""
    out: dict[str, Any] = {}
    plain = (int, float, bool, str, type(None))
    objs: list[tuple[str, Any]] = [("executor", ex)]
    for st in ex.stages:
        objs += [(f"stage{st.index}", st), (f"stage{st.index}.store", st.store)]
        if st.bridge is not None:
            objs.append((f"stage{st.index}.bridge", st.bridge))
            for g, group in enumerate(st.bridge.opt.param_groups):
                out.update({f"stage{st.index}.group{g}.{k}": v for k, v in group.items()
                            if isinstance(v, plain)})
    for name, obj in objs:
        out.update({f"{name}.{k}": v for k, v in vars(obj).items() if isinstance(v, plain)})
    return out


def _check_host(eager: dict[str, Any], replayed: dict[str, Any]) -> None:
    """After a twin replay: the host must hold what the eager step left (``eager``) in every
    field the step changed; a field the replay's bookkeeping missed is a CUDA-replay bug."""
    wrong = sorted(k for k in eager.keys() | replayed.keys() if eager.get(k) != replayed.get(k))
    if wrong:
        from engine.runtime.capture.graph_twin import ReplayDivergence

        raise ReplayDivergence(
            "host state after the replay differs from the eager step's: "
            + ", ".join(f"{k} = {replayed.get(k)!r}, eager {eager[k]!r}" for k in wrong[:5]))


class _Host:
    """The host bookkeeping of a step: what a replay (which runs no Python) must add."""

    def __init__(self, ex: Executor) -> None:
        self.ex = (ex.steps, ex.skipped_steps, ex.dropped, ex.n_base)
        self.flags = (ex.j, ex.active)
        self.stages = [(st.updates, st.skipped_updates, st.forwards, st.segment_updates,
                        st.store.version, dict(st.delay_counts), st.scheduler_owed)
                       for st in ex.stages]

    def restore(self, ex: Executor) -> None:
        ex.steps, ex.skipped_steps, ex.dropped, ex.n_base = self.ex
        ex.j, ex.active = self.flags
        for st, (u, sk, f, su, v, dc, owed) in zip(ex.stages, self.stages, strict=True):
            st.updates, st.skipped_updates, st.forwards, st.segment_updates = u, sk, f, su
            st.store.version = v
            st.delay_counts.clear()
            st.delay_counts.update(dc)
            st.scheduler_owed = owed


@contextlib.contextmanager
def deferred_schedulers(ex: Executor) -> Iterator[None]:
    """Inside the block a stage's update owes its LR scheduler's step instead of taking it
    (``Stage.scheduler_owed``): a captured window must not contain the scheduler's work (with
    a Tensor lr its ``fill_`` would be recorded with one step's value)."""
    for st in ex.stages:
        st.defer_scheduler = True
    try:
        yield
    finally:
        for st in ex.stages:
            st.defer_scheduler = False


def settle_schedulers(ex: Executor) -> None:
    """Take every LR scheduler step the last window owes, after it, stage by stage. Bitwise
    eager's order for what any update reads: a scheduler writes only its own stage's lr,
    and a synchronous step updates each stage once, after which nothing in it reads that lr."""
    for st in ex.stages:
        owed, st.scheduler_owed = st.scheduler_owed, 0
        for _ in range(owed):
            st.scheduler.step()


class _Delta:
    """What one step changed on the host, applied after each replay: counters as
    differences; the segment position by the rule the executor follows (the step's program
    is part of the capture key, so whether it ends the segment is too)."""

    def __init__(self, before: _Host, after: _Host, M: int) -> None:
        self.M = M
        self.ex = tuple(a - b for a, b in zip(after.ex[:3], before.ex[:3], strict=True))
        self.closes = not after.flags[1]
        opened = not before.flags[1]
        self.stages = []
        for b, a in zip(before.stages, after.stages, strict=True):
            counts = {d: a[5].get(d, 0) - b[5].get(d, 0) for d in a[5]}
            forwards = a[2] - (0 if opened else b[2])
            self.stages.append((a[0] - b[0], a[1] - b[1], forwards, a[4] - b[4], counts,
                                a[6] - b[6]))

    def apply(self, ex: Executor) -> None:
        ex.steps += self.ex[0]
        ex.skipped_steps += self.ex[1]
        ex.dropped += self.ex[2]
        opened = not ex.active
        for st in ex.stages:
            if opened:  # Executor._open_segment
                st.segment_updates = st.updates
                st.forwards = 0
        j = (ex.j if ex.active else 0) + 1
        if self.closes:  # Executor._close_segment
            ex.n_base += j * self.M
            ex.j, ex.active = 0, False
        else:
            ex.j, ex.active = j, True
        for st, (du, dsk, fw, dv, counts, owed) in zip(ex.stages, self.stages, strict=True):
            st.updates += du
            st.skipped_updates += dsk
            st.forwards += fw
            st.store.version += dv
            for k, n in counts.items():
                if n:
                    st.delay_counts[k] = st.delay_counts.get(k, 0) + n
            st.scheduler_owed += owed  # taken after the window (settle_schedulers)


class _Graph:
    """One captured step: its replay, its host difference and its static outputs."""

    def __init__(self, replay: Callable[[], None], delta: _Delta, out: dict[str, Any]) -> None:
        self.replay = replay
        self.delta = delta
        self.out = out  # the window's result tensors (static: the replay rewrites them)


class ProgramCapture:
    """Runs a local synchronous pipeline's steps eagerly, captured or replayed (module
    docstring); ``stats()`` is ``Pipeline.stats()["capture"]``."""

    def __init__(self, ex: Executor, backend: GraphBackend | None = None, cache: int = 4) -> None:
        self.ex = ex
        self.backend: GraphBackend = backend or _TEST_BACKEND or CudaGraphBackend()
        self.reruns_host = bool(getattr(self.backend, "reruns_host", False))
        self.cache = cache
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._staging: OrderedDict[Hashable, Staging] = OrderedDict()
        self._refused: dict[Hashable, str] = {}
        self.counts = {"captures": 0, "replays": 0, "eager": 0, "evictions": 0}
        self.reason: str | None = None
        self._out: dict[str, Any] = {}
        #: device counters of "skip_update" steps (folded by stats())
        self._bad: Tensor | None = None
        self._skipped: Tensor | None = None
        self.cpu = all(p.device.type == "cpu" for st in ex.stages for p in st.store.params)
        if ex.on_nonfinite == "skip_update":  # made here: never inside a capture
            dev = next((p.device for st in ex.stages for p in st.store.params), torch.device("cpu"))
            self._bad = torch.zeros((), dtype=torch.float32, device=dev)
            self._skipped = torch.zeros((), dtype=torch.float32, device=dev)
        for st in ex.stages:
            if st.bridge is not None and st.bridge.skip is None:
                st.bridge.enable_skip_flags()  # found_inf: the device-side skip decision
        ex.device_check = self._device_check

    # ------------------------------------------------------------------ inside the window

    def _device_check(self, losses: list[Tensor]) -> None:
        """The loss check of a synchronous step on the device: one flag per loss (1.0: not
        finite), their sum handed to every stage's update as found_inf. No host read."""
        flags = torch.stack([
            loss.detach().float().sub(loss.detach().float()).ne(0).any().float() for loss in losses
        ])
        count = flags.sum()
        for st in self.ex.stages:
            if st.bridge is not None:
                st.bridge.skip.add(count)
        self._out = {"flags": flags, "count": count}
        if self._bad is not None and self._skipped is not None:  # "skip_update"
            self._bad.add_(count.to(self._bad.device))
            self._skipped.add_(count.ne(0))  # type: ignore[union-attr]

    # ------------------------------------------------------------------ one step

    def _why_eager(self) -> str | None:
        if labels.profiling():
            return "a profiler is recording (the step's labels need an eager step)"
        if self.ex.action_hook is not None:
            return "an action hook is set (a replay would not call it)"
        if self.ex.log is not None or self.ex.cuda_events is not None:
            return "the executor is logging actions or timing events (host work at every action)"
        return None

    def run_step(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        """One synchronous step: eager, captured or replayed (module docstring). A Ctrl-C
        during it is raised when the step is complete (a replay cannot stop halfway, so
        neither does an eager step of this mode: the pipeline is consistent either way)."""
        ex = self.ex
        with ex.interrupts.deferred():
            try:
                result = self._step(xs, targets, sizes)
            finally:  # LR schedulers step outside the window, in every outcome
                settle_schedulers(ex)
        ex.interrupts.check()
        return result

    def _run(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        """The executor's step with its interrupt checks off (they come after the window)."""
        ints = self.ex.interrupts
        ints.check = _no_check  # type: ignore[method-assign]
        try:
            with deferred_schedulers(self.ex):
                result = self.ex.run_step(xs, targets, sizes)
            # with stage streams, the window is a fork-join of the caller's stream (a CUDA
            # graph must end with every forked stream joined): the updates ran on them
            self.ex.streams.join()
            return result
        finally:
            del ints.check

    def _step(self, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        ex = self.ex
        before = _Host(ex)
        point = self._point()
        self._out = {}
        skey = staging_key(xs, targets)
        if isinstance(skey, str):
            return self._finish(self._eager(xs, targets, sizes, skey), self._out, before, point)
        staging = self._staging.get(skey)
        if staging is None:
            staging = self._staging[skey] = Staging(xs, targets)
            while len(self._staging) > 2 * self.cache:  # (graphs hold their own buffers)
                self._staging.popitem(last=False)
        self._staging.move_to_end(skey)
        sx, sy = staging.stage(xs, targets)
        why = self._why_eager()
        key: Hashable = None
        if why is None:
            opts = []
            for st in ex.stages:
                if st.bridge is None:
                    continue
                k = launch_key(st.bridge.opt, (st.bridge.skip.found_inf.data_ptr(),),
                               reference_ok=self.cpu)
                if isinstance(k, str):
                    why = f"stage {st.index}: {k}"
                    break
                opts.append(k)
            # the step's compiled program (a schedule program's steps differ; catalog ones repeat)
            prog = ex.compiler.step(ex.j if ex.active else 0)
            key = (skey, tuple(sizes), tuple(opts), id(prog))
            why = why or self._refused.get(key)
        if why is not None:
            return self._finish(self._eager(sx, sy, sizes, why), self._out, before, point)
        graph = self._graphs.get(key)
        fresh = False  # a graph just captured: its first replay is the capture's step
        if graph is None and key in self._seen:
            del self._seen[key]
            graph, result = self._capture(key, sx, sy, sizes, before, staging)
            if result is not None:  # the test twin ran the window while recording it
                return self._finish(result, graph.out, before, point)
            fresh = True
        if graph is None:
            return self._finish(self._warm_up(key, sx, sy, sizes), self._out, before, point)
        self._graphs.move_to_end(key)
        if self.reruns_host:
            graph.replay()
            post = _scalars(ex)  # what the eager step left on the host
            before.restore(ex)  # the twin re-ran the Python: keep only its device work
            graph.delta.apply(ex)
            _check_host(post, _scalars(ex))
        else:
            graph.replay()
            graph.delta.apply(ex)
        self.counts["replays"] += 0 if fresh else 1
        loss = graph.out.get("loss")
        return self._finish(StepResult(None if loss is None else loss.clone()), graph.out,
                            before, point)

    def _eager(self, xs: list[Any], targets: list[Any], sizes: list[int], reason: str) -> StepResult:
        self.counts["eager"] += 1
        self.reason = reason
        return self._run(xs, targets, sizes)

    def _warm_up(self, key: Hashable, xs: list[Any], targets: list[Any], sizes: list[int]) -> StepResult:
        """A key first seen: one eager step, watched for host reads (a window that reads
        the host would replay the first answer forever: it stays eager)."""
        from engine.runtime.capture.dispatch_trace import Recorder

        rec = Recorder()
        with rec:
            result = self._run(xs, targets, sizes)
        syncs = [op for op in rec.ops if op.sync is not None
                 and not (self.cpu and op.where == REFERENCE_SKIP)]
        self.counts["eager"] += 1
        if syncs:
            op = syncs[0]
            self._refused[key] = (f"the step reads the host ({op.name}: {op.sync}, called from "
                                  f"{op.where}): not captured")
            self.reason = self._refused[key]
        else:
            known = [k for k in (*self._graphs, *self._seen) if isinstance(k, tuple)]
            if any(k[:2] == key[:2] and k[3:] == key[3:] for k in known):  # type: ignore[index]
                self.reason = ("optimizer options changed (e.g. lr: engine.optim's fused "
                               "kernels take it as a launch argument, not a device tensor, so a "
                               "new value is a new graph): captured when a later step repeats it")
            else:
                self.reason = ("a new capture key (batch shapes, micro-batch sizes or optimizer "
                               "options such as lr): captured when a later step repeats it")
            self._seen[key] = None
            while len(self._seen) > self.cache:
                self._seen.popitem(last=False)
        return result

    def _capture(self, key: Hashable, xs: list[Any], targets: list[Any], sizes: list[int],
                 before: _Host, staging: Staging) -> tuple[_Graph, StepResult | None]:
        """Record the step; returns the graph, and the step's result when the backend ran
        it while recording (a test twin). A CUDA capture runs nothing on the device: its
        host bookkeeping is undone and the caller replays."""
        ex = self.ex
        box: dict[str, StepResult] = {}

        def window() -> None:
            box["result"] = self._run(xs, targets, sizes)

        try:
            replay = self.backend.capture(window)
        except BaseException:
            before.restore(ex)
            raise
        out = dict(self._out)
        out["loss"] = box["result"].loss
        out["staging"] = staging  # the buffers the graph reads live as long as the graph
        graph = _Graph(replay, _Delta(before, _Host(ex), ex.M), out)
        self._graphs[key] = graph
        self.counts["captures"] += 1
        while len(self._graphs) > self.cache:
            self._graphs.popitem(last=False)
            self.counts["evictions"] += 1
        if self.reruns_host:
            return graph, box["result"]
        before.restore(ex)
        return graph, None

    def _point(self) -> RollbackPoint | None:
        """RNG states and module buffers before the step: a "raise" step restores them."""
        if self.ex.on_nonfinite != "raise":
            return None
        return RollbackPoint(self.ex.tracker, [] if self.cpu else [torch.cuda.current_device()])

    def _finish(self, result: StepResult, out: dict[str, Any], before: _Host,
                point: RollbackPoint | None) -> StepResult:
        """After the window: ``"raise"``/``"skip"`` read the per-loss flags once; a step whose
        updates the device skipped gets eager's outcome on the host (counters, the error)."""
        ex = self.ex
        flags = out.get("flags")
        bad = [] if flags is None or ex.on_nonfinite == "skip_update" else \
            [k for k, f in enumerate(flags.tolist()) if f]
        if not bad:
            if point is not None:
                point.commit()
            return result
        j0 = before.flags[0] if before.flags[1] else 0
        ids = [before.ex[3] + j0 * ex.M + k for k in bad]
        after = (ex.steps, ex.n_base, ex.j, ex.active)
        before.restore(ex)  # no stage updated (found_inf), as eager's skip or rollback
        ex.dropped += len(bad)
        if ex.on_nonfinite == "raise":
            if point is not None:
                point.restore()
            raise ex.nonfinite_error(ids)
        ex.steps, ex.n_base, ex.j, ex.active = after
        ex.skipped_steps += 1
        return StepResult(result.loss, len(bad), ids)

    # ------------------------------------------------------------------ facts

    def fold(self) -> None:
        """Add "skip_update"'s device counts to the executor's (one host read)."""
        if self._bad is None or self._skipped is None:
            return
        bad, skipped = (int(v) for v in torch.stack([self._bad, self._skipped]).tolist())
        self._bad.zero_()
        self._skipped.zero_()
        self.ex.dropped += bad
        self.ex.skipped_steps += skipped

    def stats(self) -> dict[str, Any]:
        return {"mode": "program", "window": "synchronous step", **self.counts,
                "graphs": len(self._graphs), "staging_buffers": len(self._staging),
                "last_eager_reason": self.reason}


def program_capture(ex: Executor) -> Any:
    """The capture layer of ``cuda_graphs="program"``: whole synchronous steps
    (:class:`ProgramCapture`), or asynchronous windows with their rings
    (:class:`engine.runtime.capture.asynchronous.AsyncCapture`)."""
    if ex.sync:
        return ProgramCapture(ex)
    return AsyncCapture(ex, _TEST_BACKEND)
