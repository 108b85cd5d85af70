"""CUDA graphs of the stages' optimizer steps (``Pipeline(cuda_graphs=True)``).

Why: a stage's update is one fused kernel launch per flat buffer plus the Python around it
(option checks, dispatch, packing some 25 launch arguments). For small stages, and for pb with
batch 1 where every micro-batch ends in an update at every stage, that host time is most of
the update. A CUDA graph replays the recorded launches with one call.

Why replays are exact: a fused kernel's launch depends on nothing but its arguments. The
*launch key* below holds all of them that can change between steps: every param group
option (lr, momentum, the delay options, ...), the address of every buffer the step reads or
writes (weights, gradients, state, predicted weights, AMP's ``grad_scale``/``found_inf``).
A step whose key was recorded replays its graph; a key first seen runs eagerly; a key seen
before (in an eager step) is captured, then replayed. So a float ``lr`` that an LR schedule
changes at every update never captures (every step runs eagerly, as without graphs), one that
changes every few hundred updates recaptures once per change, and a weight store that
alternates between two buffers (PipeDream-2BW's double buffer) keeps one graph per buffer.
An ``lr`` given as a one-element float32 tensor on the stage's device (torch's convention for
capturable optimizers; its schedulers write it in place) is loaded by the kernels on the
device: the key holds its address, not its value, so a schedule never forces a recapture
(engine/optim/lr_values.py).

What is captured: ``optimizer.step()`` only. Forwards, backwards, the weight store's version
bookkeeping and snapshots, gradient rescaling of partial groups, data-parallel all-reduces and
LR schedulers run as before, around the replay, on the same stage stream.

A step that is not in the steady state of a bound stage -- the first step (it creates the
state), a param group spread over several flat buckets (mixed dtypes: one multi-tensor launch
whose device pointer table is rebuilt when a buffer changes, which a graph would not see), a
step in which some parameter got no gradient (its ``.grad`` is hidden, so the
gradients are not all in the flat buffer), a Tensor-valued option other than a device lr (the
kernels read it on the host), optimizer step hooks (they would run at capture only), a profiler recording (labels)
-- runs eagerly; ``Pipeline.stats()["cuda_graphs"]`` counts the steps of each kind per stage
and says why the last eager step was not replayed.

Refused when the pipeline is built (nothing runs): stages off CUDA, optimizers other than
engine.optim's SGD, Adam, AdamW and NAdam (their fused kernels are what is captured; torch
optimizers and Muon's Newton-Schulz iterations are not checked for host reads), ``fused=False``
and ``differentiable=True`` groups (the reference path reads ``found_inf`` on the host).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from engine.runtime.stage import labels
from engine.runtime.stage.optim_bridge import has_step_hooks

__all__ = ["CudaGraphBackend", "StepGraphs", "attach_step_graphs", "graph_refusal", "launch_key"]

#: group entries that are not options: the params, the lr the step itself records for later
#: predictions (set from lr and lr_scale before the launch, so it lags a step behind), and
#: the first lr an LR scheduler keeps (a Tensor clone for a Tensor lr; no step reads it)
_DERIVED = ("params", "prediction_lr", "initial_lr")
#: engine.optim families whose step is the fused kernels (and nothing that reads the host)
CAPTURABLE_FAMILIES = ("sgd", "adam", "nadam")


class GraphBackend(Protocol):
    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """Record ``step`` without running it; return what replays the recording."""


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph``: the launches ``step`` makes are recorded on a capture stream
    (nothing runs) and replayed on the caller's current stream, the stage stream."""

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay  # the bound method keeps the graph alive


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _hashable(v: Any) -> Hashable:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def launch_key(opt: Any, extra: tuple[Hashable, ...] = (), *, reference_ok: bool = False
               ) -> tuple[Hashable, ...] | str:
    """Everything the next ``opt.step()``'s launches depend on, or why that step cannot be
    replayed from a graph (a str). ``extra``: the caller's arguments of the step;
    ``reference_ok``: accept the reference path (a CPU test twin replays its torch ops)."""
    if has_step_hooks(opt):
        return "optimizer step hooks are registered (a replay would not call them)"
    if labels.profiling():
        return "a profiler is recording (the step's labels need an eager step)"
    parts: list[Hashable] = [extra, _ptr(getattr(opt, "grad_scale", None)),
                             _ptr(getattr(opt, "found_inf", None))]
    for i, group in enumerate(opt.param_groups):
        params = group["params"]
        bindings = opt._group_bindings(i, group)
        if len(bindings) > 1:
            # one multi-tensor launch reads a pointer table that is rebuilt (a new device
            # tensor) whenever a bucket's buffer changes: a graph would keep reading the old one
            return (f"param group {i} spans {len(bindings)} flat buckets (one multi-tensor "
                    "launch whose pointer table is rebuilt when a buffer changes)")
        covered = 0
        buffers = []
        for b in bindings:
            if not b.initialized:
                return f"param group {i}: its first step creates the optimizer state"
            if not b.grads_in_buffer():
                return (f"param group {i}: not every gradient is in the flat gradient buffer "
                        "(a parameter took no part in this update's backwards)")
            covered += len(b.params)
            state = tuple(_ptr(t) for t in b.state.values() if isinstance(t, Tensor))
            buffers.append((_ptr(b.view.param), _ptr(b.view.grad), _ptr(b.predicted), state))
        if covered != len(params):
            return f"param group {i}: some of its parameters are outside the stage's flat buffers"
        if params and not reference_ok and not opt._fused_choice(i, group, params):
            return (f"param group {i} runs the reference path (a dtype the fused kernels do not "
                    "take)")
        options = []
        for k, v in group.items():
            if k in _DERIVED:
                continue
            if isinstance(v, Tensor):
                if k == "lr" and params and opt.device_lr(group, params[0].device) is v:
                    # read by the kernels on the device: its address is the launch argument,
                    # its value (written in place by an LR schedule) is not
                    options.append((k, ("device tensor", v.data_ptr())))
                    continue
                return (f"param group {i}'s {k!r} is a Tensor the fused kernels cannot read on "
                        "the device (only lr, as one float32 element on the params' device, "
                        "without a legacy lr_scale): pass a float, or lr as such a tensor")
            options.append((k, _hashable(v)))
        parts.append((tuple(options), tuple(buffers)))
    return tuple(parts)


class StepGraphs:
    """The optimizer step of one stage, replayed from CUDA graphs where its launch key was
    recorded (module docstring). ``cache`` graphs are kept per stage, least recently used
    dropped first."""

    def __init__(self, stage: int, opt: Any, backend: GraphBackend | None = None,
                 cache: int = 4) -> None:
        self.stage = stage
        self.opt = opt
        self.backend: GraphBackend = backend if backend is not None else CudaGraphBackend()
        self.cache = cache
        self._graphs: OrderedDict[Hashable, Callable[[], None]] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.eager = 0
        self.reason: str | None = None  # why the last eager step ran eagerly

    def run(self, step: Callable[[], None], extra: tuple[Hashable, ...] = ()) -> None:
        """One optimizer step: ``step()`` itself, or the replay of its recording."""
        key = launch_key(self.opt, extra)
        if isinstance(key, str):
            self._eager(step, key)
            return
        replay = self._graphs.get(key)
        if replay is None and key in self._seen:
            replay = self.backend.capture(step)
            self.captures += 1
            del self._seen[key]
            self._graphs[key] = replay
            while len(self._graphs) > self.cache:
                self._graphs.popitem(last=False)
        if replay is not None:
            self._graphs.move_to_end(key)
            replay()
            self.replays += 1
            return
        self._seen[key] = None
        while len(self._seen) > self.cache:
            self._seen.popitem(last=False)
        self._eager(step, "launch arguments not seen before (an option such as lr, or a buffer, "
                          "changed): recorded if a later step repeats them")

    def _eager(self, step: Callable[[], None], reason: str) -> None:
        step()
        self.eager += 1
        self.reason = reason

    def stats(self) -> dict[str, Any]:
        return {"replays": self.replays, "captures": self.captures, "eager": self.eager,
                "graphs": len(self._graphs), "last_eager_reason": self.reason}


def graph_refusal(stage: int, opt: Any, device: torch.device) -> str | None:
    """Why stage ``stage``'s optimizer step cannot be captured (None: it can)."""
    name = type(opt).__name__
    if getattr(opt, "_family", None) not in CAPTURABLE_FAMILIES or not hasattr(opt, "bind_flat"):
        qual = f"{type(opt).__module__}.{type(opt).__qualname__}"
        return (f"stage {stage}'s optimizer is {qual}; cuda_graphs captures the fused steps of "
                "engine.optim.SGD, Adam, AdamW and NAdam. Use one of them, or drop cuda_graphs")
    for i, group in enumerate(opt.param_groups):
        if group.get("fused") is False:
            return (f"stage {stage}'s {name}, param group {i}: fused=False runs the reference "
                    "path, which reads found_inf on the host; pass fused=None (or True)")
        if group.get("differentiable"):
            return (f"stage {stage}'s {name}, param group {i}: differentiable=True steps through "
                    "autograd, which a graph cannot replay")
    if device.type != "cuda":
        return (f"cuda_graphs=True captures each stage's optimizer step on its GPU, but stage "
                f"{stage}'s parameters are on {device}; CUDA graphs need CUDA (drop the option "
                "on CPU)")
    return None


def attach_step_graphs(stages: Sequence[Any], backend: GraphBackend | None = None) -> None:
    """Give each stage optimizer bridge a :class:`StepGraphs` (what cannot be captured was
    refused by :func:`graph_refusal` in ``build_store``, before the model moved)."""
    for st in stages:
        if st.bridge is not None:  # (a stage without parameters has no step)
            st.bridge.graphs = StepGraphs(st.index, st.bridge.opt, backend)
