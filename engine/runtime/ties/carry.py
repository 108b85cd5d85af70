"""Tied parameters on asynchronous schedules: the owner's value travels with the micro-batch.

Why not copies, as on synchronous schedules (ties.py): under pb, pipedream and 2bw the
holders of a tied parameter update at different times and read different versions, so two
copies would hold different values at any moment. Here the tied parameter is *one*
parameter of its owner, the lowest holding stage, updated by the owner's optimizer only;
docs/ALGORITHMS.md ("Tied parameters") states the semantics this gives:

* F(n) at the owner reads the tied weight as every other weight of the owner (the version,
  prediction or stash its schedule and mitigations choose, with the owner's delay D_owner);
  the owner's forward also outputs a copy of that value (``param.clone()``, on the
  autograd graph), which travels with micro-batch n's activation, through the stages in
  between (a view, no copy), to every later holder. A later holder runs its F(n) -- and
  its B(n), and a recomputed forward -- with that value in place of its parameter.
* The gradient a later holder computes for the value travels back with n's activation
  gradient and reaches the owner's parameter through the clone: the owner's B(n)
  accumulates the sum of every holder's contribution of micro-batch n, and the owner's
  update applies it, with the owner's delay, update group, skip flags and clipping.

So the tied weight is read by every holder of micro-batch n at the owner's version: the
model that micro-batch sees has one tied weight, and the tied weight is a weight of the
owner's with the owner's delay, for every mitigation. What it costs: the value is one more
leaf of the activation tree between the owner and the last holder (under gloo/NCCL one
message of the weight's size per micro-batch per boundary, each way), and the owner keeps
one copy per micro-batch in flight between its forward and its backward.

The later holders' parameters leave their modules (a plain ``None`` attribute, so no arena,
optimizer or state_dict entry holds them); hooks on the stage modules split the carried
values off the input, install them for the call, and append the carried values to the
output, so every path that calls a stage module (training, recomputation, dry runs,
``evaluate``, gloo/NCCL) sees the same wiring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineConfigError

__all__ = ["carry_ties", "carried_in", "carried_out"]


def carried_in(groups: list[Any], s: int) -> list[int]:
    """Indices of the groups whose value enters stage ``s`` with its input."""
    return [k for k, g in enumerate(groups) if g.stages[0] < s <= g.stages[-1]]


def carried_out(groups: list[Any], s: int) -> list[int]:
    """Indices of the groups whose value leaves stage ``s`` with its output."""
    return [k for k, g in enumerate(groups) if g.stages[0] <= s < g.stages[-1]]


def carry_ties(groups: list[Any], modules: dict[int, nn.Module], spec: Any) -> None:
    """Set the carried ties up on the stage modules built here (stage -> module): later
    holders' parameters leave their modules, and every stage between an owner and its last
    holder gets the hooks of :class:`_Carrier`."""
    for g in groups:
        if len({s for s, _ in g.holders}) != len(g.holders):
            raise PipelineConfigError(
                f"ties: group ({g.describe()}) names one stage twice; on {spec.describe()} a "
                "tied parameter has one holder per stage"
            )
        g.carried = True
    for s, module in modules.items():
        ins, outs = carried_in(groups, s), carried_out(groups, s)
        if not ins and not outs:
            continue
        owned: dict[int, nn.Parameter] = {}
        reads: dict[int, list[tuple[nn.Module, str]]] = {}
        for k, g in enumerate(groups):
            name = dict(g.holders).get(s)
            if name is None:
                continue
            param = _param(module, s, name)
            if g.stages[0] == s:
                owned[k] = param
                continue
            slots = [
                (sub, key) for sub in module.modules()
                for key, value in sub.named_parameters(recurse=False, remove_duplicate=False)
                if value is param
            ]
            for sub, key in slots:
                delattr(sub, key)  # no longer a parameter here: read from the carried value
                setattr(sub, key, None)  # (_Carrier.before installs it for each call)
            reads[k] = slots
        _Carrier(s, module, ins, outs, owned, reads)


def _param(module: nn.Module, s: int, name: str) -> nn.Parameter:
    params = dict(module.named_parameters())
    if name not in params:
        raise PipelineConfigError(f"ties: stage {s} has no parameter {name!r}")
    return params[name]


class _Carrier:
    """The hooks of one stage module: ``before`` takes ``(input, carried values)`` apart and
    installs the values this stage reads; ``after`` returns ``(output, values passed on)``."""

    def __init__(
        self,
        s: int,
        module: nn.Module,
        ins: list[int],
        outs: list[int],
        owned: dict[int, nn.Parameter],
        reads: dict[int, list[tuple[nn.Module, str]]],
    ) -> None:
        self.s, self.ins, self.outs, self.owned, self.reads = s, ins, outs, owned, reads
        self._values: dict[int, Tensor] = {}
        if ins:
            module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after)

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs or len(args) != 2 or not isinstance(args[1], tuple) or len(args[1]) != len(self.ins):
            raise PipelineConfigError(
                f"stage {self.s} holds a tied parameter carried from an earlier stage and "
                f"expects (input, {len(self.ins)} tied value(s)); got {len(args)} positional "
                f"and {len(kwargs)} keyword arguments"
            )
        x, values = args
        self._values = dict(zip(self.ins, values, strict=True))
        for k, slots in self.reads.items():
            for sub, key in slots:
                setattr(sub, key, self._values[k])  # a plain attribute, for this call only
        if isinstance(x, tuple) and not isinstance(x, torch.Size):  # trees.call's rule
            return x, {}
        if isinstance(x, dict):
            return (), x
        return (x,), {}

    def after(self, module: nn.Module, args: Any, out: Any) -> Any:
        values, self._values = self._values, {}
        for slots in self.reads.values():
            for sub, key in slots:
                setattr(sub, key, None)
        if not self.outs:
            return None
        sent = tuple(
            self.owned[k].clone() if k in self.owned else values[k].view_as(values[k])
            for k in self.outs
        )
        return out, sent
