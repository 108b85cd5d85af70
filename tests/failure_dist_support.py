"""Multi-process phases of the step protocol's exception guarantees (gloo): a Ctrl-C, a
non-finite loss, an optimizer that raises and an exception inside a user stage, on one rank
or on all, each compared with the local run doing the same recovery.

Why a file of its own: distributed_support.py is at the line cap; its worker finds these
phases by the name ``failure_dist_support:<phase>``."""

from __future__ import annotations

from distributed_support import transport_under_test
import os
import signal
import tempfile
import time
import traceback
from typing import Any

import torch
from distributed_support import batch, configs, stage_factories
from torch import nn

STEPS, AT = 5, 2  # steps of each run; the step that fails
SYNC = ("gpipe", "1f1b-adam")
ASYNC = ("pb", "pipedream")


def _pipe(S: int, name: str, **extra: Any) -> Any:
    from engine import Pipeline

    kw = dict(configs(S)[name], **extra)
    return Pipeline(stage_factories(S), loss_fn=nn.functional.mse_loss, **kw)


def _weights(pipe: Any, stages: list[int] | None = None) -> list[torch.Tensor]:
    held = stages if stages is not None else [st.index for st in pipe.stages]
    return [p.detach().clone() for s in held for p in pipe.parts.executor.by_index[s].module.parameters()]


def _sigint_during_forward(module: nn.Module) -> Any:
    """A Ctrl-C (SIGINT to this process) in the middle of the module's next forward."""
    state = {"armed": True}

    def hook(mod: nn.Module, inp: Any) -> None:
        if state["armed"]:
            state["armed"] = False
            os.kill(os.getpid(), signal.SIGINT)

    return module.register_forward_pre_hook(hook)


def _fail_optimizer(st: Any) -> None:
    """The stage's optimizer raises at its next step (once; a step pre-hook)."""
    state: dict[str, Any] = {}

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        state["handle"].remove()
        raise RuntimeError("injected optimizer failure")

    state["handle"] = st.bridge.opt.register_step_pre_hook(hook)


def _local_recovery(S: int, name: str, case: str, stage: int) -> tuple[Any, int]:
    """The local run of ``case`` with its documented recovery; returns (pipe, pipe.steps)."""
    from engine.errors import NonFiniteLossError

    on_nonfinite = {"on_nonfinite": "raise"} if case == "nonfinite" else {}
    ref = _pipe(S, name, **on_nonfinite)
    for t in range(STEPS):
        x, y = batch(t)
        if t != AT:
            ref.step(x, y)
        elif case.startswith("sigint"):  # a Ctrl-C between two actions of stage `stage`
            done = False

            def hook(s: int, kind: str, mb: int) -> None:
                nonlocal done
                if not done and s == stage and kind == "F":
                    done = True
                    raise KeyboardInterrupt
            ref.parts.executor.action_hook = hook
            try:
                ref.step(x, y)
            except KeyboardInterrupt:
                pass
            ref.parts.executor.action_hook = None
            if ref.parts.executor.sync:  # rolled back: the same step again (the rank's completed)
                ref.step(x, y)
        elif case == "nonfinite":
            try:
                ref.step(x, torch.full_like(y, float("nan")))
            except NonFiniteLossError:
                pass
        elif case == "optimizer":
            _fail_optimizer(ref.stages[stage])
            try:
                ref.step(x, y)
            except RuntimeError:
                pass
        if t == AT:  # as the gloo run, which flushes to save
            ref.flush()
    ref.flush()
    return ref, ref.steps


def phase_recover(rank: int, S: int, names: list[str]) -> dict[str, Any]:
    """Each case on the gloo pipeline: what every rank raised at step AT, the step counter,
    engine.save after it, and the weights after STEPS steps vs the local recovery.

    A worker of a pytest started in the background inherits SIGINT as ignored, which the
    engine leaves ignored: the Ctrl-C cases set Python's default handler themselves."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _recover(rank, S, names)
    finally:
        signal.signal(signal.SIGINT, previous)


def _recover(rank: int, S: int, names: list[str]) -> dict[str, Any]:
    import engine
    from engine.errors import NonFiniteLossError

    out: dict[str, Any] = {}
    for name in names:
        sync = name in SYNC
        cases = ["sigint-all", "sigint-one"] + (["nonfinite", "optimizer"] if sync else [])
        for case in cases:
            victim = S - 1 if case == "sigint-one" else 1  # the rank that fails
            key = f"{name}/{case}"
            try:
                extra = {"on_nonfinite": "raise"} if case == "nonfinite" else {}
                pipe = _pipe(S, name, transport=transport_under_test(), timeout=15, **extra)
                raised = None
                for t in range(STEPS):
                    x, y = batch(t)
                    hook = None
                    if t == AT:
                        if case == "sigint-all" or (case == "sigint-one" and rank == victim):
                            hook = _sigint_during_forward(pipe.stages[0].module)
                        elif case == "nonfinite":
                            y = torch.full_like(y, float("nan"))
                        elif case == "optimizer" and rank == victim:
                            _fail_optimizer(pipe.stages[0])
                    try:
                        pipe.step(x, y)
                    except (KeyboardInterrupt, NonFiniteLossError, RuntimeError) as exc:
                        raised = (t, type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", [])))
                    finally:
                        if hook is not None:
                            hook.remove()
                    if t == AT:  # every rank (a collective): flushed, then saved
                        steps_after = pipe.steps
                        pipe.flush()
                        engine.save(pipe, os.path.join(tempfile.mkdtemp(prefix=f"f{rank}-"), "ck"))
                pipe.flush()
                ref, ref_steps = _local_recovery(S, name, case, victim)
                held = [st.index for st in pipe.stages]
                out[key] = {
                    "raised": raised,
                    "steps_after": steps_after,
                    "steps": pipe.steps,
                    "ref_steps": ref_steps,
                    "weights_equal": all(
                        torch.equal(a, b)
                        for a, b in zip(_weights(pipe), _weights(ref, held), strict=True)
                    ),
                }
            except Exception:
                out[key] = {"error": traceback.format_exc()}
    return out


class _Boom(nn.Module):
    """A stage that raises ValueError in its forward (or its backward) when armed;
    "last-backward": in the backward of the last micro-batch of the step it is armed for
    (``chunks`` forwards), the first stage's last action: every other rank's lane has ended."""

    def __init__(self, inner: nn.Module, where: str, chunks: int = 4) -> None:
        super().__init__()
        self.inner, self.where, self.armed = inner, where, False
        self.once = False  # disarm at the first failure (a transient error)
        self.chunks, self.armed_forwards = chunks, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.where == "forward":
            self.armed = not self.once
            raise ValueError("injected failure in the user's forward")
        y = self.inner(x)
        if self.armed and self.where == "last-backward":
            self.armed_forwards += 1
            if self.armed_forwards % self.chunks == 0:
                return _RaiseInBackward.apply(y)
        if self.armed and self.where == "backward":
            self.armed = not self.once
            return _RaiseInBackward.apply(y)
        return y


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("injected failure in the user's backward")


def phase_stage_error(
    rank: int, S: int, victim: int, where: str, name: str, R: int = 1
) -> dict[str, Any]:
    """A user stage raises mid-step on ``victim`` where no frame can tell the peers (``R``
    data-parallel replicas; terminal phase): it raises the user's error with a note, every
    other rank a PeerError naming it within the timeout."""
    from engine import Pipeline

    kw = dict(configs(S)[name], data_parallel=R)
    factories = stage_factories(S)
    stages = [lambda f=f: _Boom(f(), where) for f in factories]
    pipe = Pipeline(stages, loss_fn=nn.functional.mse_loss, transport=transport_under_test(), timeout=4, **kw)
    try:
        for t in range(STEPS):
            if t == AT and rank == victim:
                pipe.stages[0].module.armed = True
            pipe.step(*batch(t))
        return {"type": None}
    except Exception as exc:
        if rank == victim:  # stay up (rank 0 hosts the store holding the first failure's note)
            time.sleep(6)
        return {"type": type(exc).__name__, "message": str(exc),
                "notes": "\n".join(getattr(exc, "__notes__", []))}


def _boom_pipe(S: int, name: str, where: str, **extra: Any) -> Any:
    from engine import Pipeline

    kw = dict(configs(S)[name], **extra)
    stages = [lambda f=f: _Boom(f(), where, kw["chunks"]) for f in stage_factories(S)]
    return Pipeline(stages, loss_fn=nn.functional.mse_loss, **kw)


def _boom_step(pipe: Any, module: Any, t: int) -> tuple[Any, ...] | None:
    """Step t with ``module`` (None: not on this rank) raising once; then the same step
    again, as a rolled-back synchronous step is retried. Returns what step t raised."""
    x, y = batch(t)
    raised = None
    if module is not None:
        module.armed = True
    try:
        pipe.step(x, y)
    except Exception as exc:
        raised = (type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", [])))
    if module is not None:
        module.armed = False
    if raised is not None:
        pipe.step(x, y)
    return raised


def phase_stage_recover(rank: int, S: int, names: list[str], cases: list[list[Any]]) -> dict[str, Any]:
    """A user stage raises inside a synchronous gloo step on ``victim`` (each case: victim,
    "forward" or "backward"): every rank rolls back and raises, the step is retried, engine.save
    works, and the weights after STEPS steps equal the local run's same recovery."""
    import engine

    out: dict[str, Any] = {}
    for name in names:
        for victim, where in cases:
            key = f"{name}/{victim}/{where}"
            try:
                pipe = _boom_pipe(S, name, where, transport=transport_under_test(), timeout=20)
                raised = None
                for t in range(STEPS):
                    if t != AT:
                        pipe.step(*batch(t))
                        continue
                    steps_before = pipe.steps
                    raised = _boom_step(pipe, pipe.stages[0].module if rank == victim else None, t)
                    engine.save(pipe, os.path.join(tempfile.mkdtemp(prefix=f"r{rank}-"), "ck"))
                ref = _boom_pipe(S, name, where)
                for t in range(STEPS):
                    if t != AT:
                        ref.step(*batch(t))
                    else:
                        _boom_step(ref, ref.stages[victim].module, t)
                held = [st.index for st in pipe.stages]
                out[key] = {
                    "raised": raised, "steps_before": steps_before, "steps": pipe.steps,
                    "ref_steps": ref.steps,
                    "weights_equal": all(
                        torch.equal(a, b)
                        for a, b in zip(_weights(pipe), _weights(ref, held), strict=True)
                    ),
                }
            except Exception:
                out[key] = {"error": traceback.format_exc()}
    return out


def phase_async_drop(rank: int, S: int, names: list[str], cases: list[list[Any]]) -> dict[str, Any]:
    """A user stage raises inside an asynchronous gloo step on ``victim``: it drops that
    micro-batch as the local run does (the others are told by dropped frames and go on), the
    victim raises after the step, flush and engine.save work, and the weights after STEPS
    steps equal the local run's (the same exception, its step's rest run by the next step)."""
    import engine

    out: dict[str, Any] = {}
    for name in names:
        for victim, where in cases:
            key = f"{name}/{victim}/{where}"
            try:
                runs = []
                for gloo in (True, False):
                    extra = dict(transport=transport_under_test(), timeout=20) if gloo else {}
                    pipe = _boom_pipe(S, name, where, **extra)
                    raised = None
                    for t in range(STEPS):
                        module = None
                        if t == AT and (rank == victim or not gloo):
                            module = pipe.stages[0 if gloo else victim].module
                            module.armed = module.once = True
                        try:
                            pipe.step(*batch(t))
                        except Exception as exc:
                            raised = (type(exc).__name__, str(exc), "\n".join(getattr(exc, "__notes__", [])))
                        if module is not None:
                            module.armed = False
                        if t == AT:
                            pipe.flush()
                            if gloo:
                                engine.save(pipe, os.path.join(tempfile.mkdtemp(prefix=f"d{rank}-"), "ck"))
                    pipe.flush()
                    runs.append((pipe, raised))
                (pipe, raised), (ref, _) = runs
                held = [st.index for st in pipe.stages]
                out[key] = {
                    "raised": raised, "steps": pipe.steps,
                    "dropped": pipe.parts.executor.dropped, "ref_dropped": ref.parts.executor.dropped,
                    "weights_equal": all(
                        torch.equal(a, b)
                        for a, b in zip(_weights(pipe), _weights(ref, held), strict=True)
                    ),
                }
            except Exception:
                out[key] = {"error": traceback.format_exc()}
    return out
