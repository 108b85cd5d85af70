"""Gradient-norm clipping across pipeline stages (``Pipeline(clip_grad_norm=...)``).

Why a module: the norm that matters spans every stage (and every data-parallel replica),
which no single stage sees, and asynchronous schedules have no global gradient at the moment
a stage updates. docs/ALGORITHMS.md, "Gradient clipping", states both semantics:

* Synchronous schedules: the global norm of the step's gradient, exactly as
  ``torch.nn.utils.clip_grad_norm_`` computes it on the unpipelined model -- one norm per
  parameter (``torch._foreach_norm``, parameters in module order, stage 0 first, a tied
  parameter counted once at its first holder), stacked, the norm of the stack -- and the
  gradients multiplied in place by ``min(max_norm / (norm + 1e-6), 1)``, a 0-dim device
  tensor. Multiplying (not dividing by a ``grad_scale``) is what torch does, so the update
  equals clip + step on the unpipelined model bit for bit on CPU. Under gloo/NCCL every rank
  writes its stages' per-parameter norms into its slots of one vector (zeros elsewhere) and
  one ``all_reduce`` (sum over the pipeline's ranks) assembles it: adding zeros is exact, so
  every rank stacks the same values the local run stacks. Data-parallel replicas clip after
  their gradients were averaged (the all-reduce of the update), so they agree without a
  further reduction. Nothing is read on the host.
* Asynchronous schedules: each stage clips its own update group's gradient by that group's
  own norm (the stage's parameters only), when it updates: what ``clip_grad_norm_`` over the
  stage's parameters in an optimizer pre-step hook would do. It composes with everything
  that acts on the gradient afterwards (the optimizer's mitigations read the clipped
  gradient) and with ``skip_update`` (a flagged group's norm is not finite; its update is
  skipped on the device anyway).

A parameter that received no gradient in the group is left out of an asynchronous stage's
norm (torch skips a ``.grad`` of None); in the synchronous global norm it contributes a zero,
so that the slot layout is the same on every rank (the norm then equals torch's up to the
rounding of one longer sum).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.errors import PipelineConfigError

if TYPE_CHECKING:
    from engine.runtime.stage.stage import Stage

__all__ = ["GradClipper", "check_clip_options"]


def check_clip_options(max_norm: object, norm_type: object) -> tuple[float | None, float]:
    """Validated (max_norm or None, norm_type)."""
    if isinstance(norm_type, str) and norm_type == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise PipelineConfigError(
            f"clip_norm_type={norm_type!r} must be a positive number or float('inf') "
            "(the p of the p-norm, as torch.nn.utils.clip_grad_norm_'s norm_type)"
        )
    if max_norm is None:
        return None, float(norm_type)
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not (max_norm > 0 and math.isfinite(max_norm))
    ):
        raise PipelineConfigError(
            f"clip_grad_norm={max_norm!r} must be a positive finite number (the max_norm of "
            "torch.nn.utils.clip_grad_norm_), or None for no clipping"
        )
    return float(max_norm), float(norm_type)


class GradClipper:
    """Clips the gradients of the stages this process holds (module docstring).

    Args:
        max_norm, norm_type: as ``torch.nn.utils.clip_grad_norm_``.
        stages: the Stage objects held here.
        synchronous: global norm per step (True) or per stage and update group (False).
        ties: tie groups (engine.runtime.ties.groups): later holders' copies are not counted.
    """

    def __init__(
        self, max_norm: float, norm_type: float, stages: list[Stage], synchronous: bool,
        ties: list[Any] | None = None,
    ) -> None:
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.synchronous = synchronous
        self.stages = stages
        #: per stage: store indices of its counted parameters, in module order
        self.counted: dict[int, list[int]] = {st.index: self._counted(st, ties or []) for st in stages}
        self.group: Any = None  # process group of the pipeline's ranks (gloo/NCCL)
        self.device: torch.device | None = None
        #: per stage: first slot of its parameters in the global norm vector
        self.offsets: dict[int, int] = {}
        self.total_slots = 0
        self._place(sorted(self.counted), lambda s: len(self.counted[s]))
        #: last norms, device tensors: per stage (the global norm for synchronous schedules)
        self.last: dict[int, Tensor] = {}
        self._coef: Tensor | None = None
        #: tensor parallelism: the stage's tp group, over which shard norms are combined
        #: (engine/runtime/tensor_parallel.py); None otherwise
        self.tp_group: Any = None

    @staticmethod
    def _counted(st: Stage, ties: list[Any]) -> list[int]:
        later = {name for g in ties for s, name in g.holders[1:] if s == st.index}
        store = st.store
        named = dict(st.module.named_parameters())
        return [
            store.index_of(p) for name, p in named.items()
            if p.requires_grad and name not in later and store.params and _in(store, p)
        ]

    def _place(self, stages: Any, count: Any) -> None:
        off = 0
        for s in stages:
            self.offsets[s] = off
            off += count(s)
        self.total_slots = off

    def connect(self, group: Any, num_stages: int, device: torch.device) -> None:
        """Under gloo/NCCL: learn every stage's parameter count (one all-reduce, at build
        time, on every rank) so that each rank knows its stages' slots."""
        import torch.distributed as dist

        counts = torch.zeros(num_stages, dtype=torch.int64, device=device)
        for s, idx in self.counted.items():
            counts[s] = len(idx)
        dist.all_reduce(counts, group=group)
        self.group = group
        self.device = device
        per = [int(c) for c in counts.tolist()]
        self._place(range(num_stages), lambda s: per[s])

    # ------------------------------------------------------------------ norms

    def _norms(self, st: Stage, used_only: bool) -> list[Tensor]:
        store = st.store
        params = [store.params[i] for i in self.counted[st.index]]
        if used_only:
            keep = [store.was_used(i) for i in self.counted[st.index]]
            params = [p for p, k in zip(params, keep, strict=True) if k]
        params = [p for p in params if p.grad is not None]
        if not params:
            return []
        return self._whole(params, list(torch._foreach_norm([p.grad for p in params], self.norm_type)))

    def _whole(self, params: list[Tensor], norms: list[Tensor]) -> list[Tensor]:
        """Tensor parallelism: whole parameters' norms from the shards' (one all-reduce)."""
        if self.tp_group is None:
            return norms
        from engine.runtime.tensor_parallel import reduce_norms

        return reduce_norms(params, norms, self.norm_type, self.tp_group)

    def _coefficient(self, total: Tensor) -> Tensor:
        coef = self.max_norm / (total + 1e-6)
        return torch.clamp(coef, max=1.0)

    def begin_step(self, stages: list[Stage], found_inf: Tensor | None = None) -> None:
        """Synchronous: the global norm over ``stages`` (those that update this step, with
        their final gradients) and every other rank's; sets the coefficient :meth:`apply` uses.
        ``found_inf`` (float16 loss scaling) rides in the same all-reduce, summed in place."""
        slots: list[Tensor | None] = [None] * self.total_slots
        device = None
        for st in stages:
            idx = self.counted.get(st.index, [])
            if not idx:
                continue
            store = st.store
            grads = [store.params[i].grad for i in idx]
            used = [store.was_used(i) and g is not None for i, g in zip(idx, grads, strict=True)]
            live = [g for g, u in zip(grads, used, strict=True) if u]
            norms = iter(self._whole(
                [store.params[i] for i, u in zip(idx, used, strict=True) if u],
                list(torch._foreach_norm(live, self.norm_type)),
            )) if live else iter(())
            off = self.offsets[st.index]
            for k, u in enumerate(used):
                if u:
                    slots[off + k] = next(norms)
            if live and device is None:
                device = live[0].device
        device = self.device or device
        if device is None:
            device = next((p.device for st in self.stages for p in st.store.params), torch.device("cpu"))
        dtype = next((t.dtype for t in slots if t is not None), torch.float32)
        zero = torch.zeros((), dtype=dtype, device=device)
        parts = [zero if t is None else t.to(device) for t in slots] or [zero]
        n = len(parts)
        if found_inf is not None and self.group is not None:
            parts.append(found_inf.to(device, dtype))
        vec = torch.stack(parts)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(vec, group=self.group)
            if found_inf is not None:
                found_inf.copy_(vec[n])
        total = torch.linalg.vector_norm(vec[:n], self.norm_type)
        self._coef = self._coefficient(total)
        for st in self.stages:
            self.last[st.index] = total

    def apply(self, st: Stage) -> None:
        """Scale ``st``'s gradients in place before its optimizer step (synchronous: by the
        step's coefficient; asynchronous: by its own update group's)."""
        if self.synchronous:
            coef = self._coef  # the update phase's (begin_step)
            assert coef is not None, "a synchronous stage updated outside its update phase"
        else:
            norms = self._norms(st, used_only=True)
            if not norms:
                return
            total = torch.linalg.vector_norm(torch.stack(norms), self.norm_type)
            self.last[st.index] = total
            coef = self._coefficient(total)
        flats = st.store.grad_flats()
        if flats:
            torch._foreach_mul_(flats, coef.to(flats[0].device))

    def stats(self) -> list[Tensor | None]:
        return [self.last.get(st.index) for st in self.stages]


def _in(store: Any, p: Any) -> bool:
    return any(q is p for q in store.params)
