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
* Loss scaling (float16, asynchronous schedules): a *static* scale S = ``init_scale``. A
  micro-batch's gradients reach the stages' updates at different times, so a scale that
  changed in between would unscale them with the wrong value; with S fixed, every stage
  unscales its own update group by 1/S when it updates, and a non-finite value sets that
  group's found_inf in the device flags (engine/runtime/device_flags.py: the same
  accumulator ``on_nonfinite="skip_update"`` uses), so the group is skipped whole on the
  device -- one skip decision per update group, no host read. engine.optim optimizers only.
  Multiplying by a power of two and back is exact except where a float16 gradient is
  subnormal, so without overflow the weights equal those of float16 training with no loss
  scaling up to that rounding (bit for bit with S = 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.errors import PipelineConfigError

__all__ = [
    "check_grad_scaler", "SCALER_DEFAULTS", "LossScaler", "autocast_context", "check_scaler_state",
]

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

    def unscale_group(self, st: Any) -> None:
        """Asynchronous: stage ``st``'s update group times 1/S, a non-finite value flagged in
        the stage's found_inf accumulator (the device flags), so its optimizer skips the
        group on the device; counted per stage."""
        flats = st.store.grad_flats()
        skip = st.bridge.skip
        if not flats or skip is None:
            return
        inv = self.scale.double().reciprocal().float().to(flats[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(flats, skip.found_inf, inv)
        counter = self.group_skips.get(st.index)
        if counter is None:
            counter = self.group_skips[st.index] = torch.zeros_like(skip.found_inf)
        counter.add_(skip.found_inf.ne(0))

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

    def state_dict(self) -> dict[str, Tensor]:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.scale.copy_(state["scale"])
        self.growth_tracker.copy_(state["growth_tracker"])


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
