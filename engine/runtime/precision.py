"""Mixed precision for a pipeline: autocast per stage, dynamic loss scaling across stages.

Why a module: ``Pipeline(autocast=torch.bfloat16 | torch.float16)`` must give what torch's own
recipe gives on the unpipelined model -- ``torch.autocast`` around the forward and the loss,
and for float16 ``torch.amp.GradScaler`` -- although the model is cut into stages that run at
different times (and under gloo/NCCL in different processes). docs/ALGORITHMS.md, "Mixed
precision":

* Autocast: every stage function (the forward, and its recomputation inside the backward,
  and the loss at the last stage) runs under ``torch.autocast(device, dtype)``: the stage's
  ``_run`` enters it itself, so a recomputation cannot run under another state. Weights stay
  float32 in the arena; activations between stages travel in whatever dtype autocast gave.
* Loss scaling (float16, synchronous schedules): one scale tensor S on the device. The last
  stage's backward root is ``(loss * 1/M) * S`` (GradScaler's ``scale``). Before the update
  phase every stage's final gradient is unscaled in place by ``1/S`` (``(S.double()
  .reciprocal()).float()``, as GradScaler) with torch's fused non-finite check writing one
  shared ``found_inf``; under gloo/NCCL the found_inf of every rank is summed (in the same
  all-reduce as clipping's norms, when clipping is on). That single found_inf is *the* skip
  decision of the step for every stage: engine.optim optimizers take it on the device
  (GradScaler's ``found_inf`` protocol), torch.optim optimizers are skipped after one host
  read (as GradScaler does). Then S is updated by ``torch._amp_update_scale_`` with
  GradScaler's growth/backoff rule -- so a pipelined float16 run skips exactly the steps an
  unpipelined run with GradScaler skips, and its weights are the same bit for bit on CPU.
* Loss scaling (float16, asynchronous schedules): no step spans the stages, so every stage s
  keeps its own GradScaler state (scale S_s, growth tracker) and applies GradScaler's rule to
  its own update groups. The backward of micro-batch i at stage s runs under the stage's
  current S_s: the last stage's root is ``(loss * w) * S_s``; an earlier stage multiplies the
  incoming gradient, computed downstream under scale c (which travels with it: a 1-element
  message under gloo/NCCL), by S_s / c first. S_s changes only at the stage's own updates, so
  every gradient of an update group carries the same factor however the scales moved while
  the micro-batch was in flight. At the update the group is unscaled by 1/S_s with the fused
  non-finite check writing the stage's found_inf accumulator of the device flags
  (engine/runtime/stage/device_flags.py: the one ``on_nonfinite="skip_update"`` uses), which also
  holds the non-finite check of every input gradient the stage sent in the group (so a stage
  whose outgoing gradient overflows backs off itself); the optimizer skips the group on the
  device when it is set, and ``torch._amp_update_scale_`` moves S_s with GradScaler's
  growth/backoff rule. One skip decision per update group and stage, no host read.
  engine.optim optimizers only. With the default power-of-two factors, the rescaling S_s / c
  is exact (up to float16 subnormals), so a run without overflow equals float16 training
  without loss scaling up to that rounding; with one stage it is GradScaler with the group's
  micro-batches accumulated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.errors import PipelineConfigError

__all__ = [
    "AUTOCAST_DTYPES", "check_grad_scaler", "check_precision", "SCALER_DEFAULTS", "LossScaler",
    "attach_precision", "autocast_context", "check_scaler_state",
]

#: the values of ``Pipeline(autocast=...)`` besides None
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

#: torch.amp.GradScaler's defaults
SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}


def check_grad_scaler(options: Any, autocast: torch.dtype | None) -> dict[str, Any]:
    """The loss scaler's options (GradScaler's keywords) for ``autocast=torch.float16``."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise PipelineConfigError(
            f"grad_scaler={options!r} must be a dict of torch.amp.GradScaler keywords "
            f"({', '.join(SCALER_DEFAULTS)}) or None"
        )
    unknown = sorted(set(options) - set(SCALER_DEFAULTS))
    if unknown:
        raise PipelineConfigError(
            f"grad_scaler: unknown option(s) {unknown}; known: {sorted(SCALER_DEFAULTS)}"
        )
    if options and autocast is not torch.float16:
        raise PipelineConfigError(
            "grad_scaler options apply to dynamic loss scaling, which runs with "
            f"autocast=torch.float16 only (got autocast={autocast!r})"
        )
    merged = {**SCALER_DEFAULTS, **options}
    for k in ("init_scale", "growth_factor"):
        v = merged[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > (1.0 if k == "growth_factor" else 0.0):
            raise PipelineConfigError(f"grad_scaler[{k!r}]={v!r} must be a number > {1 if k == 'growth_factor' else 0}")
    b = merged["backoff_factor"]
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 < b < 1.0:
        raise PipelineConfigError(f"grad_scaler['backoff_factor']={b!r} must lie in (0, 1)")
    gi = merged["growth_interval"]
    if isinstance(gi, bool) or not isinstance(gi, int) or gi < 1:
        raise PipelineConfigError(f"grad_scaler['growth_interval']={gi!r} must be an int >= 1")
    return merged if autocast is torch.float16 else {}


def autocast_context(dtype: torch.dtype, device_type: str) -> Any:
    """The autocast state every stage function runs under."""
    return torch.autocast(device_type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling of a synchronous pipeline (module docstring): the scale, the
    growth tracker and the step's found_inf, all device tensors; nothing read on the host
    unless a torch.optim optimizer must be skipped."""

    def __init__(self, options: dict[str, Any], device: torch.device, synchronous: bool = True) -> None:
        #: asynchronous schedules: a static scale, each stage's update group unscaled and
        #: checked on its own, the found_inf going to the device flags (module docstring)
        self.synchronous = synchronous
        self.scale = torch.full((), float(options["init_scale"]), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        #: steps skipped because of found_inf (a device counter; stats() reads it)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.growth_factor = float(options["growth_factor"])
        self.backoff_factor = float(options["backoff_factor"])
        self.growth_interval = int(options["growth_interval"])
        self.group: Any = None  # the pipeline's process group (gloo/NCCL)
        self._copies: dict[torch.device, Tensor] = {}  # found_inf on other devices
        self._host_skip: bool | None = None  # this step's decision, once read on the host
        #: asynchronous: per stage, update groups whose found_inf was set (device counters)
        self.group_skips: dict[int, Tensor] = {}
        #: asynchronous: per stage its scale, growth tracker and found_inf (module docstring)
        self.stage_scale: dict[int, Tensor] = {}
        self.stage_tracker: dict[int, Tensor] = {}
        self.stage_found: dict[int, Tensor] = {}
        #: asynchronous: (receiving stage, micro-batch) -> the scale the gradient travelling
        #: to it was computed under (set by the sender, or by the transport on arrival)
        self.carried: dict[tuple[int, int], Tensor] = {}
        self._init = float(options["init_scale"])
        self._ones: dict[torch.device, Tensor] = {}

    def scaled(self, root: Tensor) -> Tensor:
        """GradScaler.scale: the backward root times S."""
        return root * self.scale.to(device=root.device, non_blocking=True)

    def unscale(self, stages: list[Any]) -> None:
        """Every updating stage's final gradient times 1/S, non-finite values flagged in the
        shared found_inf (cleared first: one decision per step)."""
        self.found_inf.zero_()
        inv = self.scale.double().reciprocal().float()
        for st in stages:
            flats = st.store.grad_flats() if st.bridge is not None and st.pending_weight > 0 else []
            if not flats:
                continue
            dev = flats[0].device
            if dev == self.found_inf.device:
                torch._amp_foreach_non_finite_check_and_unscale_(flats, self.found_inf, inv.to(dev))
            else:  # a stage on another device: its own flag, added (GradScaler: per device)
                flag = torch.zeros_like(self.found_inf, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(flats, flag, inv.to(dev))
                self.found_inf.add_(flag.to(self.found_inf.device))

    # ------------------------------------------------------------- asynchronous schedules

    def add_stage(self, st: Any) -> None:
        """Asynchronous: stage ``st``'s own GradScaler state, on its device; its found_inf is
        the device flags' accumulator (a stage without parameters gets one of its own)."""
        dev = st.store.params[0].device if st.store.params else self.scale.device
        self.stage_scale[st.index] = torch.full((), self._init, dtype=torch.float32, device=dev)
        self.stage_tracker[st.index] = torch.zeros((), dtype=torch.int32, device=dev)
        skip = st.bridge.skip if st.bridge is not None else None
        self.stage_found[st.index] = (
            skip.found_inf if skip is not None else torch.zeros((), dtype=torch.float32, device=dev)
        )

    def root(self, st: Any, out: Tensor) -> Tensor:
        """Asynchronous: the last stage's backward root under its current scale."""
        return out * self.stage_scale[st.index]

    def before_backward(self, st: Any, i: int, grad: Any, entry: Any) -> Any:
        """Asynchronous: micro-batch ``i``'s backward at ``st`` starts under the stage's own
        scale: the arriving gradient moved to it (:meth:`incoming`), the last stage's loss
        (its stash ``entry``'s root) scaled by it (:meth:`root`)."""
        grad = self.incoming(st, i, grad)
        if st.is_last and not entry.dropped and isinstance(entry.out, Tensor):
            entry.out = self.root(st, entry.out)
        return grad

    def incoming(self, st: Any, i: int, grad: Any) -> Any:
        """Asynchronous: micro-batch ``i``'s gradient arriving at ``st``, moved from the
        sender's scale c to the stage's own: times S_s / c (1.0 when they agree: exact)."""
        c = self.carried.pop((st.index, i), None)
        if c is None or grad is None or not isinstance(grad, (Tensor, list, tuple)):
            return grad  # (None: nothing arrived; DROPPED: passed on as it is)
        scale = self.stage_scale[st.index]
        ratio = scale / c.to(scale.device).reshape(())
        if isinstance(grad, Tensor):
            return grad * ratio.to(grad.device)
        return [g if g is None else g * ratio.to(g.device) for g in grad]

    def outgoing(self, st: Any, i: int, gin: Any) -> None:
        """Asynchronous: the input gradient ``st`` sends upstream for micro-batch ``i``:
        checked for non-finite values into the stage's found_inf, its scale carried along."""
        found = self.stage_found[st.index]
        ts = [gin] if isinstance(gin, Tensor) else [g for g in (gin or ()) if isinstance(g, Tensor)]
        ts = [t for t in ts if t.is_floating_point()]
        if ts:
            one = self._ones.get(found.device)
            if one is None:
                one = self._ones[found.device] = torch.ones((), dtype=torch.float32, device=found.device)
            # (multiplies by 1.0 in place: the values do not change)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        self.carried[(st.index - 1, i)] = self.stage_scale[st.index].clone()

    def unscale_group(self, st: Any) -> None:
        """Asynchronous: stage ``st``'s update group times 1/S_s, a non-finite value flagged in
        the stage's found_inf (the device flags), so its optimizer skips the group on the
        device; then S_s moves by GradScaler's rule. Counted per stage."""
        s = st.index
        found, scale = self.stage_found[s], self.stage_scale[s]
        flats = st.store.grad_flats() if st.bridge is not None else []
        if flats:
            inv = scale.double().reciprocal().float().to(flats[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(flats, found, inv)
        counter = self.group_skips.get(s)
        if counter is None:
            counter = self.group_skips[s] = torch.zeros_like(found)
        counter.add_(found.ne(0))
        torch._amp_update_scale_(
            scale, self.stage_tracker[s], found,
            self.growth_factor, self.backoff_factor, self.growth_interval,
        )
        if st.bridge is None or st.bridge.skip is None:  # no optimizer consumes it
            found.zero_()

    def reduce(self) -> None:
        """Under gloo/NCCL: every rank's found_inf summed (when clipping is off; clipping
        carries it in its own all-reduce)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(self.found_inf, group=self.group)

    def found_inf_on(self, device: torch.device) -> Tensor:
        """The step's found_inf as a tensor on ``device`` (an optimizer reads it on its
        parameters' device): the shared one, or a copy refreshed by :meth:`update`."""
        if device == self.found_inf.device:
            return self.found_inf
        return self._copies.setdefault(device, torch.zeros_like(self.found_inf, device=device))

    def update(self) -> None:
        """GradScaler.update: back off after a non-finite step, grow after growth_interval
        finite ones (on the device); the step's decision reaches every device's copy."""
        self._host_skip = None
        for copy in self._copies.values():
            copy.copy_(self.found_inf)
        self.skipped.add_(self.found_inf.ne(0))
        torch._amp_update_scale_(
            self.scale, self.growth_tracker, self.found_inf,
            self.growth_factor, self.backoff_factor, self.growth_interval,
        )

    def skip_on_host(self) -> bool:
        """For a torch.optim optimizer (it takes no found_inf): one host read, as GradScaler."""
        if self._host_skip is None:  # once per step, however many stages ask
            self._host_skip = bool(self.found_inf.item() != 0)
        return self._host_skip

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}
        if not self.synchronous:  # per stage, and the scales of gradients in flight (tensors only)
            idx = sorted(self.stage_scale)
            out["stage_index"] = torch.tensor(idx, dtype=torch.int64)
            out["stage_scale"] = torch.stack([self.stage_scale[s].cpu() for s in idx])
            out["stage_tracker"] = torch.stack([self.stage_tracker[s].cpu() for s in idx])
            keys = sorted(self.carried)
            out["carried_key"] = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)
            out["carried_scale"] = torch.stack([self.carried[k].reshape(()).cpu() for k in keys]) \
                if keys else torch.zeros(0)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.synchronous:  # (checked before anything changes)
            saved = [] if "stage_index" not in state else state["stage_index"].tolist()
            missing = sorted(set(self.stage_scale) - set(saved))
            if missing:
                raise PipelineConfigError(
                    f"the checkpoint has no float16 loss scale for stage(s) {missing} (saved "
                    "by an engine before asynchronous schedules scaled per stage, or by "
                    "another pipeline)"
                )
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])
        if self.synchronous:
            return
        for k, s in enumerate(state["stage_index"].tolist()):
            if s in self.stage_scale:
                self.stage_scale[s].copy_(state["stage_scale"][k])
                self.stage_tracker[s].copy_(state["stage_tracker"][k])
        mine = set(self.stage_scale)  # (a key names the receiver; the sender may hold it)
        self.carried = {
            (s, i): state["carried_scale"][k].to(self.scale.device).clone()
            for k, (s, i) in enumerate(state["carried_key"].tolist()) if {s, s + 1} & mine
        }


def check_scaler_state(scaler: LossScaler | None, state: dict[str, Any]) -> None:
    """A checkpoint and a pipeline agree on float16 loss scaling (``load_state_dict``)."""
    saved = state.get("loss_scaler")
    if (saved is None) != (scaler is None):
        raise PipelineConfigError(
            "the checkpoint was saved " + ("with" if saved is not None else "without")
            + " float16 loss scaling and this pipeline runs "
            + ("with" if scaler is not None else "without")
            + " it; build the pipeline with the same autocast option"
        )


def check_precision(autocast: object, grad_scaler: object) -> dict[str, Any]:
    """``Pipeline(autocast=..., grad_scaler=...)`` checked before any weight exists: the loss
    scaler's options (GradScaler's defaults filled in), or a PipelineConfigError."""
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise PipelineConfigError(
            f"autocast={autocast!r}: pass torch.bfloat16, torch.float16 or None (weights stay "
            "float32 in the arena; each stage's forward runs under torch.autocast)"
        )
    return check_grad_scaler(grad_scaler, autocast)  # type: ignore[arg-type]


def attach_precision(
    autocast: torch.dtype, scaler_options: dict[str, Any], ex: Any, stages: list[Any], spec: Any,
    device: torch.device, group: Any = None,
) -> None:
    """Autocast on every built stage, and for float16 the loss scaler on the stages and their
    executor ``ex`` (module docstring; ``group``: the pipeline's process group under gloo/NCCL)."""
    for st in stages:  # each stage's own device (a local pipeline may span devices)
        dev = st.store.params[0].device if st.store.params else device
        st.autocast = (autocast, dev.type)
    if autocast is not torch.float16:
        return
    sync = spec.synchronous
    if not sync:
        _check_async_optimizers(stages, spec)
        if spec.split_backward:
            raise PipelineConfigError(
                f"autocast=torch.float16 with {spec.describe()}: an asynchronous program "
                "that splits backwards into B and W could apply a micro-batch's weight gradient "
                "in an update group other than its B's, under another loss scale (precision.py); "
                "use autocast=torch.bfloat16 or a program without split backwards"
            )
    scaler = LossScaler(scaler_options, device, synchronous=sync)
    scaler.group = group
    ex.loss_scaler = scaler
    for st in stages:
        st.loss_scaler = scaler
        if st.bridge is None or not st.bridge.is_engine:
            continue
        if sync:  # GradScaler's protocol: the optimizer skips its whole update on the device
            dev = st.store.params[0].device if st.store.params else device
            st.bridge.opt.found_inf = scaler.found_inf_on(dev)
        elif st.bridge.skip is None:  # the device flags take each update group's found_inf
            st.bridge.enable_skip_flags()
    if not sync:  # one GradScaler state per stage; gradients carry their scale (precision.py)
        for st in stages:
            scaler.add_stage(st)
        for tp in getattr(ex, "transports", {}).values():
            tp.scales = True
            ex.carry_scales = True


def _check_async_optimizers(stages: list[Any], spec: Any) -> None:
    for st in stages:
        b = st.bridge
        if b is not None and b.opt is not None and not b.is_engine:
            raise PipelineConfigError(
                f"autocast=torch.float16 with {spec.describe()}: stage {st.index}'s "
                f"optimizer is a {type(b.opt).__module__}.{type(b.opt).__qualname__}, which takes "
                "no found_inf to skip an overflowing update group on the device; use an "
                "engine.optim optimizer, autocast=torch.bfloat16, or a synchronous schedule"
            )
