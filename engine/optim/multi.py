"""One fused launch per param group and dtype signature: the optimizer side of multi-tensor apply.

Why: the fused path used to launch one kernel per tensor (params not in a flat buffer) and
one per flat bucket, and spent ~25 us of Python per parameter per step (state lookups keyed
by Tensor, predicted-buffer bookkeeping, argument checks) before each launch. Here a group's
fused tensors are sorted once per *layout* into launches (one per dtype signature and
first-step flag) whose pointer tables (``engine.triton_kernels.multi.SegmentTable``) are
built and validated then; a step only confirms the layout still holds and launches.

What a step checks (C-level maps over cached lists, no dictionary lookup keyed by a Tensor):
the same parameter objects with the same data pointers, the optimizer's ``state`` the same
object with the same number of entries and no state tensor replaced by the optimizer itself
(``_state_version``), the same state keys and prediction setting, and contiguous gradients.
Fresh gradient tensors (autograd allocates new ones per step unless they are kept) change
only the gradient row of each table: one list of pointers, one copy. Anything else rebuilds
the layout (it also runs on the first step, when SGD's momentum is initialised). A state
tensor replaced by hand (``opt.state[p]["exp_avg"] = t``) is not seen: load a state_dict to
replace state.

Tensors the kernels cannot take keep the per-tensor path: sparse gradients, zero-size,
non-contiguous (param, gradient or state) and non-fused dtypes; so do Adam/NAdam tensors whose
step count is on another device or shared with another tensor (as after a flat bucket's
update), since each launch advances each count once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engine.optim.dispatch import FUSED_DTYPES

__all__ = ["MultiTensorSteps", "STATE_ROLES"]

#: optimizer state key -> operand role of the multi-tensor kernels
STATE_ROLES = {"momentum_buffer": "buf", "exp_avg": "m", "exp_avg_sq": "v",
               "max_exp_avg_sq": "vmax", "last_update": "last", "delta": "delta",
               "step": "step", "mu_product": "prod"}
_GRAD = operator.attrgetter("grad")
_PTR = Tensor.data_ptr
_CONTIGUOUS = Tensor.is_contiguous


def _signature(param: Tensor, grad: Tensor, state: dict[str, Tensor],
               predicted: Tensor | None, init: bool) -> tuple[Any, ...]:
    """What one launch shares: every operand's dtype, whether a prediction is written, the
    first-step flag."""
    return (param.dtype, grad.dtype, tuple(t.dtype for t in state.values()),
            predicted is not None and predicted.dtype, init)


def _segment_table(kernel: Any, params: list[Tensor], grads: list[Tensor],
                   state: dict[str, list[Tensor]], predicted: list[Tensor] | None) -> Any:
    """The kernel's segment table over these operands (state keys mapped to their roles)."""
    rows: dict[str, list[Tensor] | None] = {"param": params, "grad": grads}
    rows.update({STATE_ROLES[k]: v for k, v in state.items()})
    if predicted is not None:
        rows["pred"] = predicted
    return kernel.table(rows)


@dataclass(eq=False)
class Launch:
    """One multi-tensor launch: its table, the state lists the family's update call forwards,
    its first-step flag, and which of the layout's fused params it covers."""

    table: Any
    state: dict[str, list[Tensor]]
    predicted: list[Tensor] | None
    init: bool
    span: slice


@dataclass(eq=False)
class Layout:
    """A group's cached per-tensor layout (module docstring)."""

    params: list[Tensor]
    key: tuple[Any, ...]
    state_obj: Any
    fused: list[Tensor] = field(default_factory=list)  # launched params, launch by launch
    param_ptrs: list[int] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    rest: list[Tensor] = field(default_factory=list)
    fresh: bool = False


class MultiTensorSteps:
    """The multi-tensor path of :class:`~engine.optim.base.DelayOptimizer` (a mixin)."""

    _family: str
    _paths: Any  # engine.optim.dispatch.UpdatePaths
    _shared_scalars: tuple[tuple[str, float], ...]
    state: Any
    #: group id -> (group, its layout); the group is kept so that its id stays its own
    _layouts: dict[int, tuple[dict[str, Any], Layout]]
    _state_version: int
    param_groups: list[dict[str, Any]]
    #: group id -> (group, {dtype signature: (data pointers, table)}) of several flat buckets
    _bucket_tables: dict[int, tuple[dict[str, Any], dict[tuple[Any, ...], tuple[Any, Any]]]]

    def _multi_tensors(self, group: dict[str, Any], params: list[Tensor],
                       grad_scale: Tensor | None, found_inf: Tensor | None) -> list[Tensor]:
        """Update ``params`` (all with a gradient) with one launch per dtype signature;
        returns the params left to the per-tensor path."""
        layouts = self._layouts
        key = self._layout_key(group)
        entry = layouts.get(id(group))
        layout = entry[1] if entry is not None and entry[0] is group else None
        if layout is None or not self._layout_holds(layout, params, key):
            layout = self._build_layout(group, params, key)
            self._forget_dead_groups(layouts)
            layouts[id(group)] = (group, layout)
        fn = self._paths.fused
        for launch in layout.launches:
            self._call_update(fn, group, launch.table, None, launch.state, launch.init,
                              launch.predicted, grad_scale, found_inf)
            launch.table.release("grad")  # the table keeps no gradient alive between steps
        if layout.fresh:
            del layouts[id(group)]  # first step done: SGD's next launch is not an INIT one
        return layout.rest

    def _layout_key(self, group: dict[str, Any]) -> tuple[Any, ...]:
        pred = group["prediction"]
        return (len(self.state), self._state_version,
                tuple(self._state_keys(group)), pred, pred and self._horizon(group))

    def _layout_holds(self, layout: Layout, params: list[Tensor], key: tuple[Any, ...]) -> bool:
        """The steady-state check (module docstring); refreshes the gradient rows."""
        if layout.key != key or layout.state_obj is not self.state:
            return False
        if len(params) != len(layout.params) or not all(map(operator.is_, params, layout.params)):
            return False
        fused = layout.fused
        try:
            if list(map(_PTR, fused)) != layout.param_ptrs or not all(map(_CONTIGUOUS, fused)):
                return False
            grads = list(map(_GRAD, fused))
            if not all(map(_CONTIGUOUS, grads)):
                return False
            ptrs = list(map(_PTR, grads))
        except RuntimeError:  # a sparse gradient appeared: the build sorts it out
            return False
        # torch's .grad setter keeps a gradient's dtype, shape and device those of its param
        for launch in layout.launches:
            launch.table.refresh("grad", grads[launch.span], ptrs[launch.span])
        return True

    def _build_layout(self, group: dict[str, Any], params: list[Tensor],
                      key: tuple[Any, ...]) -> Layout:
        keys = list(self._state_keys(group)) + [k for k, _ in self._shared_scalars]
        scalar_keys = {k for k, _ in self._shared_scalars}
        layout = Layout(params=list(params), key=key, state_obj=self.state)
        by_sig: dict[tuple[Any, ...], list[tuple[Tensor, dict[str, Tensor], Tensor | None]]] = {}
        counts_seen: set[int] = set()
        for p in params:
            g = p.grad
            state = self.state.get(p)
            if (g.is_sparse or p.numel() == 0 or p.dtype not in FUSED_DTYPES
                    or not p.is_contiguous() or not g.is_contiguous()
                    or (state and not all(state[k].is_contiguous() for k in keys
                                          if k in state and k not in scalar_keys))):
                layout.rest.append(p)
                continue
            state = {} if state is None else state
            init = self._ensure_state(group, p, state)
            if state and p not in self.state:
                self.state[p] = state
            counts = [state[k] for k in scalar_keys]
            if any(id(c) in counts_seen or c.device != p.device or c.dtype != torch.float32
                   for c in counts):
                layout.rest.append(p)  # shared or off-device counts: one update per tensor
                continue
            counts_seen.update(map(id, counts))
            tensors = {k: state[k] for k in keys}
            predicted = self._predicted_buffer(group, p, p)
            sig = _signature(p, g, tensors, predicted, init)
            by_sig.setdefault(sig, []).append((p, tensors, predicted))
        kernel = self._paths.fused
        start = 0
        for sig, items in by_sig.items():
            ps = [p for p, _, _ in items]
            state_lists = {k: [t[k] for _, t, _ in items] for k in keys}
            predicted = [pr for _, _, pr in items] if items[0][2] is not None else None
            table = _segment_table(kernel, ps, list(map(_GRAD, ps)), state_lists, predicted)
            span = slice(start, start + len(ps))
            start += len(ps)
            layout.launches.append(Launch(table, state_lists, predicted, sig[-1], span))
            layout.fused.extend(ps)
            layout.fresh |= sig[-1]
        layout.key = self._layout_key(group)  # with the state entries just created
        layout.param_ptrs = list(map(_PTR, layout.fused))
        return layout

    def _multi_buckets(self, group: dict[str, Any], batch: list[tuple[Any, ...]],
                       grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """Several flat buckets of one group, each prepared as (param, grad, state, init,
        predicted): one launch per dtype signature. The tables are cached by the buckets'
        data pointers (a handful per bucket; the arena swaps a live buffer in place)."""
        by_sig: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        for item in batch:
            param, grad, tensors, init, predicted = item
            by_sig.setdefault(_signature(param, grad, tensors, predicted, init), []).append(item)
        fn = self._paths.fused
        entry = self._bucket_tables.get(id(group))
        if entry is None or entry[0] is not group:
            entry = self._bucket_tables[id(group)] = (group, {})
        cache = entry[1]
        for sig, items in by_sig.items():
            keys = list(items[0][2])
            ptrs = tuple(t.data_ptr() for param, grad, tensors, _, pred in items
                         for t in (param, grad, *tensors.values(), *([pred] if pred is not None else [])))
            cached = cache.get(sig)
            if cached is None or cached[0] != ptrs:
                self._forget_dead_groups(self._bucket_tables)
                table = _segment_table(
                    fn, [i[0] for i in items], [i[1] for i in items],
                    {k: [i[2][k] for i in items] for k in keys},
                    [i[4] for i in items] if sig[3] is not False else None)
                cached = cache[sig] = (ptrs, table)
            table = cached[1]
            state_lists = {k: table.tensors(STATE_ROLES[k]) for k in keys}
            predicted = table.tensors("pred") if table.has("pred") else None
            self._call_update(fn, group, table, None, state_lists, sig[-1], predicted,
                              grad_scale, found_inf)

    def _forget_dead_groups(self, cache: dict[int, tuple[dict[str, Any], Any]]) -> None:
        """Drop the entries of groups no longer in ``param_groups`` (load_state_dict replaces
        them), with the state tensors their tables hold; runs on a rebuild only."""
        live = {id(g): g for g in self.param_groups}
        for k in [k for k, (g, _) in cache.items() if live.get(k) is not g]:
            del cache[k]

    def _bump_state_version(self) -> None:
        """The optimizer replaced a state tensor (flat views, shared counts): layouts rebuild."""
        self._state_version += 1
