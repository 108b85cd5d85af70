"""Shared helpers of the runtime tests (no tests here): tiny probe models and version history.

A stage is Sequential(Probe(d), Linear(d, d), Tanh) (the last ends in Linear(d, 1)); the
probe's weight changes with every update, so its value identifies which version of the
stage's weights an F or a B read. ``History`` records, through the optimizer's step post
hook, the probe weight (and the momentum buffer and PipeMare delta when present) after every
update: ``hist.w[s][t]`` is stage s's probe weight after t updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine import Pipeline
from engine.testing import Probe

D = 3


def probe_stages(S: int, d: int = D, seed: int = 0) -> tuple[list[nn.Module], list[Probe]]:
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    probes: list[Probe] = []
    for s in range(S):
        probe = Probe(d, init=1.0 + 0.1 * s)
        last = s == S - 1
        layers = [probe, nn.Linear(d, 1 if last else d)]
        if not last:
            layers.append(nn.Tanh())
        stages.append(nn.Sequential(*layers))
        probes.append(probe)
    return stages, probes


class History:
    """Probe weight / momentum / delta of each stage after every update (index = version)."""

    def __init__(self, S: int) -> None:
        self.w: list[list[torch.Tensor]] = [[] for _ in range(S)]
        self.v: list[list[torch.Tensor | None]] = [[] for _ in range(S)]
        self.delta: list[list[torch.Tensor | None]] = [[] for _ in range(S)]
        self.lr: list[list[float]] = [[] for _ in range(S)]
        self._next = 0

    def factory(
        self, make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
        """Wrap an optimizer factory; stages call it in order 0..S-1."""

        def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            s = self._next
            self._next += 1
            opt = make(params)
            p0 = params[0]  # the probe's weight: first parameter of the stage

            def snap(*_: Any) -> None:
                st = opt.state.get(p0, {})
                self.w[s].append(p0.detach().clone())
                buf = st.get("momentum_buffer")
                self.v[s].append(None if buf is None else buf.detach().clone())
                dl = st.get("delta")
                self.delta[s].append(None if dl is None else dl.detach().clone())
                g = opt.param_groups[0]
                self.lr[s].append(float(g["lr"]) * float(g.get("lr_scale", 1.0)))

            snap()
            opt.register_step_post_hook(snap)
            return opt

        return build


def reads(probes: list[Probe]) -> dict[tuple[int, int, str], list[torch.Tensor]]:
    """(stage, micro-batch, kind) -> values read, from every probe's log."""
    out: dict[tuple[int, int, str], list[torch.Tensor]] = {}
    for probe in probes:
        for rec in probe.log:
            out.setdefault((rec["stage"], rec["mb"], rec["kind"]), []).append(rec["value"])
    return out


def data(
    steps: int, batch: int, d: int = D, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, d, generator=g), torch.randn(batch, 1, generator=g))
        for _ in range(steps)
    ]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def make_pipe(
    S: int, schedule: str, M: int, opt: Callable[..., Any], **kw: Any
) -> tuple[Pipeline, list[Probe], History]:
    stages, probes = probe_stages(S)
    hist = History(S)
    pipe = Pipeline(
        stages,
        schedule=schedule,
        chunks=M,
        loss_fn=mse,
        optimizer=hist.factory(opt),
        trace=True,
        **kw,
    )
    return pipe, probes, hist
