"""What the runtime asks of a stage optimizer, for engine.optim and plain torch.optim alike.

Why a bridge: the mitigations are options of the stage optimizers (engine.optim's ``delay``,
``prediction``, ``discrepancy_correction``), but users may also hand the pipeline a plain
``torch.optim`` optimizer. The runtime needs three things from either:

* ``step``: one update over the stage's flat gradient buffers. An engine optimizer is handed
  its flat buffers explicitly once (:meth:`engine.optim.DelayOptimizer.bind_flat`: one fused
  launch per bucket, no registry lookups, no gradient copies) and, when a forward reads the
  prediction, writes the predicted weights straight into the stage's transient buffer in the
  same pass. Parameters that took no part in this update's backwards are hidden from the
  optimizer (``.grad`` None) exactly as torch.optim skips them.
* ``write_prediction`` / ``write_backward_weights``: the predicted or PipeMare-corrected
  weights written into a buffer of the weight store, when the step did not already.
* the delay D_s, written into every param group.

For plain torch optimizers the prediction is computed here from SGD's momentum buffer and
PipeMare's delta is tracked here, with the formulas of ALGORITHMS.md. Lists are in the
weight store's parameter order (the order the optimizer factory received the parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.optim.optimizer as _torch_optimizer
from torch import Tensor

from engine.optim.flat import FlatBinding
from engine.optim.functional import prediction_coeff
from engine.runtime.stage import labels
from engine.runtime.stage.device_flags import SkipFlags

if TYPE_CHECKING:
    from engine.runtime.stage.weight_store import WeightStore

__all__ = ["OptimizerBridge"]


class StepReplayer(Protocol):
    """What runs a bridge's step from recorded graphs (engine.runtime.capture.optimizer_graphs,
    a floor above this one, attaches it)."""

    def run(self, step: Callable[[], None], extra: tuple[Hashable, ...] = ()) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def has_step_hooks(opt: Any) -> bool:
    """Whether step hooks are registered on ``opt`` or for every optimizer (an eager step
    must then go through ``opt.step()``, and a replay would skip them)."""
    return bool(
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
    )


def _stepped(opt: Any) -> None:
    """What an LR scheduler's wrapper of ``opt.step`` records (else it warns that
    ``scheduler.step()`` ran before ``optimizer.step()``)."""
    opt._opt_called = True


def _is_engine_optimizer(opt: Any) -> bool:
    return hasattr(opt, "bind_flat") and hasattr(opt, "predict_into")


class OptimizerBridge:
    """Wraps one stage optimizer whose params are the stage's shadow parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, shadow: list[torch.nn.Parameter]) -> None:
        self.opt = optimizer
        self.shadow = shadow
        self._index = {id(p): i for i, p in enumerate(shadow)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self._index:
                    raise ValueError(
                        "the stage optimizer holds a tensor that is not one of the parameters the "
                        "pipeline passed to the optimizer factory; build it from the params argument "
                        "(e.g. optimizer=lambda params: engine.optim.SGD(params, lr=0.1))"
                    )
        self.is_engine = _is_engine_optimizer(optimizer)
        self._bindings: list[FlatBinding | None] = []  # per arena bucket
        self._delta: list[Tensor] | None = None  # fallback T2 delta (torch.optim only)
        self._fallback_t2 = False
        self._decay = 0.1
        self.delay = 0
        #: CUDA graphs of the step (Pipeline(cuda_graphs=True); engine.runtime.capture.optimizer_graphs)
        self.graphs: StepReplayer | None = None
        #: on_nonfinite="skip_update": the found_inf accumulator every step hands the optimizer
        self.skip: SkipFlags | None = None

    # ------------------------------------------------------------------ options

    def set_delay(self, delay: int) -> None:
        """Tell the optimizer its stage's D_s (engine.optim reads group["delay"])."""
        self.delay = int(delay)
        for group in self.opt.param_groups:
            group["delay"] = int(delay)

    def group_option(self, key: str) -> Any:
        """The option's value if every group agrees, else raise (mixed settings per stage are
        ambiguous for the runtime's weight policy)."""
        values = {repr(g.get(key)) for g in self.opt.param_groups}
        if len(values) > 1:
            raise ValueError(f"param groups of one stage disagree on {key!r}: {sorted(values)}")
        return self.opt.param_groups[0].get(key) if self.opt.param_groups else None

    def set_group_option(self, key: str, value: Any) -> None:
        for group in self.opt.param_groups:
            group[key] = value

    def default_horizon(self) -> float:
        """The prediction horizon of a request without one: the optimizer's
        ``prediction_horizon``, else the stage's delay."""
        h = self.opt.param_groups[0].get("prediction_horizon") if self.opt.param_groups else None
        return float(self.delay if h is None else h)

    def serve(self, prediction: bool, correction: bool, decay: float) -> None:
        """Have the weights the pipeline's mitigations read computed: an engine optimizer is
        asked to predict (``prediction="linear"`` unless it already predicts, maybe in the
        momentum form) or to keep PipeMare's delta (with decay ``decay`` unless it keeps one
        already), through its validated :meth:`~engine.optim.DelayOptimizer.set_group_options`
        (a ValueError names what it refuses); for a plain torch optimizer the bridge computes
        the prediction itself and tracks the delta here."""
        if not self.is_engine:
            self._fallback_t2, self._decay = correction, decay
            return
        options: dict[str, Any] = {}
        if prediction and not self.predicts:
            options["prediction"] = "linear"
        if correction and not self.keeps_delta:
            options.update(discrepancy_correction=True, correction_decay=decay)
        if options:
            self.opt.set_group_options(**options)

    def enable_skip_flags(self) -> None:
        """Skip updates on the device when a flagged micro-batch is in the group
        (engine.runtime.stage.device_flags; engine optimizers only, checked before)."""
        self.skip = SkipFlags(self.shadow[0].device if self.shadow else torch.device("cpu"))

    def flag(self, flag: Tensor) -> None:
        """A backward of a flagged micro-batch joined the pending group."""
        if self.skip is not None:
            self.skip.add(flag)

    @property
    def keeps_delta(self) -> bool:
        return self.is_engine and bool(self.group_option("discrepancy_correction"))

    @property
    def predicts(self) -> bool:
        return self.is_engine and self.group_option("prediction") is not None

    # ------------------------------------------------------------------ binding

    def bind(self, store: WeightStore) -> None:
        """Hand an engine optimizer the arena's flat buffers of every trainable bucket."""
        arena = store.arena
        self._bindings = []
        if arena is None:
            return
        where = {id(p): i for i, p in enumerate(store.params)}
        stepped = {id(p) for g in self.opt.param_groups for p in g["params"]}
        for b, info in enumerate(arena.buckets):
            view = arena.flat_view(b)
            members = tuple(self.shadow[where[id(p)]] for p in view.params)
            if not info.requires_grad or not all(id(m) in stepped for m in members):
                self._bindings.append(None)  # frozen, or not given to the optimizer
                continue
            self._bindings.append(FlatBinding(view=view, params=members))
        if self.is_engine:
            self.opt.bind_flat([x for x in self._bindings if x is not None])

    # ------------------------------------------------------------------ update

    def step(self, store: WeightStore, prediction_key: Any) -> Any:
        """One optimizer step; returns ``prediction_key`` when the step wrote that prediction
        into the store's transient (so the next forward reads it without recomputing)."""
        unused = store.unused_params()
        saved = [(self.shadow[i], self.shadow[i].grad) for i in unused]
        for sp, _g in saved:
            sp.grad = None
        try:
            if not self.is_engine:
                self._torch_step()
                return None
            # a skipped step (found_inf) writes no prediction, and whether it skips is known
            # on the device only: the transient is then filled lazily by the next forward
            want = (
                prediction_key is not None
                and self.skip is None
                and self.opt.param_groups[0].get("prediction") is not None
                and self._default_horizon(prediction_key)
            )
            outs = store.transient_flats() if want else None
            for b, binding in enumerate(self._bindings):
                if binding is not None:
                    binding.predicted = outs[b] if outs is not None else None
            if self.skip is not None:
                self._step(self.skip.found_inf)
                self.skip.after_step()
            else:
                self._step()
            if want and self.opt.last_step_predicted:
                outs = store.transient_flats()
                lives = store.live_flats()
                for b, binding in enumerate(self._bindings):
                    if binding is None:  # frozen weights: the prediction is the weights
                        outs[b].copy_(lives[b])
                return prediction_key
            return None
        finally:
            for sp, g in saved:
                sp.grad = g

    def _default_horizon(self, key: Any) -> bool:
        """Whether the fused step's prediction (the optimizer's default horizon) is ``key``."""
        horizon = key[1]
        if horizon is None:
            return True
        g = self.opt.param_groups[0]
        h = g.get("prediction_horizon")
        return float(g["delay"] if h is None else h) == float(horizon)

    def _step(self, found_inf: Tensor | None = None) -> None:
        """``opt.step()`` (with ``found_inf`` when given), replayed from a CUDA graph where one
        was recorded for the same launch arguments (``self.graphs``; ``found_inf`` is one
        persistent tensor, so its address repeats)."""
        if self.graphs is None:
            self._eager_step(found_inf)
            return
        extra = (found_inf.data_ptr(),) if found_inf is not None else ()
        self.graphs.run(lambda: self._eager_step(found_inf), extra)
        _stepped(self.opt)

    def _eager_step(self, found_inf: Tensor | None = None) -> None:
        """``opt.step()``; without step hooks and with no profiler recording, the step
        function itself, skipping torch's per-call profiler label and hook machinery (the
        label alone costs a dispatcher round trip per update)."""
        opt = self.opt
        raw = getattr(type(opt).step, "__wrapped__", None)
        if raw is None or labels.profiling() or has_step_hooks(opt):
            opt.step() if found_inf is None else opt.step(found_inf=found_inf)
        else:
            raw(opt) if found_inf is None else raw(opt, found_inf=found_inf)
            _stepped(opt)

    def _torch_step(self) -> None:
        if not self._fallback_t2 or self.delay == 0:
            self._step()
            return
        before = [p.detach().clone() for p in self.shadow]
        self._step()
        gamma = self._decay ** (1.0 / self.delay)
        if self._delta is None:
            self._delta = [torch.zeros_like(b) for b in before]
        with torch.no_grad():
            for d, b, p in zip(self._delta, before, self.shadow, strict=True):
                d.mul_(gamma).add_(p.detach() - b, alpha=1.0 - gamma)

    # ------------------------------------------------------------------ computed weights

    def write_prediction(self, horizon: float | None, store: WeightStore, buf: int) -> None:
        """w_hat into buffer ``buf``: the optimizer's prediction with ``horizon`` (None: its
        default), or for torch.optim SGD w - lr * H * v (``momentum`` mode: m + ... + m^H)."""
        if self.is_engine:
            outs = store.flats(buf)
            lives = store.live_flats()
            bound = [outs[b] for b, x in enumerate(self._bindings) if x is not None]
            self.opt.predict_into(horizon, bound)
            for b, binding in enumerate(self._bindings):
                if binding is None:
                    outs[b].copy_(lives[b])
            return
        h = float(self.delay if horizon is None else horizon)
        for p, out in zip(self.shadow, store.views(buf), strict=True):
            group = next(g for g in self.opt.param_groups if any(q is p for q in g["params"]))
            mom = self.opt.state.get(p, {}).get("momentum_buffer")
            if mom is None or h == 0:
                out.copy_(p.detach())
                continue
            lr = float(group["lr"]) * float(group.get("lr_scale", 1.0))
            coeff = prediction_coeff(group.get("prediction") or "linear", lr,
                                     float(group.get("momentum", 0.0)), h)
            torch.add(p.detach(), mom, alpha=-coeff, out=out)

    def write_backward_weights(self, store: WeightStore, buf: int) -> None:
        """PipeMare T2's w - tau_s * delta into buffer ``buf`` (live weights where no delta)."""
        if self.is_engine and self.keeps_delta:
            outs = store.flats(buf)
            lives = store.live_flats()
            bound = [outs[b] for b, x in enumerate(self._bindings) if x is not None]
            self.opt.backward_weights_into(bound)
            for b, binding in enumerate(self._bindings):
                if binding is None:
                    outs[b].copy_(lives[b])
            return
        views = store.views(buf)
        if self._delta is None:
            for p, out in zip(self.shadow, views, strict=True):
                out.copy_(p.detach())
            return
        for p, d, out in zip(self.shadow, self._delta, views, strict=True):
            torch.add(p.detach(), d, alpha=-float(self.delay), out=out)

    # ------------------------------------------------------------------ state

    def extra_state(self) -> dict[str, Tensor]:
        """Runtime-owned optimizer state (the fallback delta) for checkpoints."""
        if self._delta is None:
            return {}
        return {f"delta.{i}": d for i, d in enumerate(self._delta)}

    def load_extra_state(self, tensors: dict[str, Tensor]) -> None:
        if not tensors:
            self._delta = None
            return
        self._delta = [tensors[f"delta.{i}"].clone() for i in range(len(self.shadow))]
