"""An independent float64 reference for tied parameters on asynchronous schedules (no
pipeline, no engine code): docs/ALGORITHMS.md's version tables and update rules, written out
per micro-batch, with the tie's semantics -- one tied weight owned by its lowest holder,
updated by the owner with the owner's delay, and read by every holder of micro-batch n at the
value the owner's forward of n read (tests/runtime/ties/test_runtime_ties_async.py).

Micro-batch n at stage s (n counted from 0, k the update size, w = S - 1 - s):

* pipedream: F and B read version max(n - w, 0) // k; 2bw: max(n // M - 1, 0);
  pb (dataflow): F reads max(n - 2w, 0) // k, B the live version n // k.
* LWP: F reads w_t - lr * D_s * v_t; SpecTrain: F w_t - s_F lr v_t, B w_t - s_B lr v_t;
  PipeMare T2: B reads w_t - D_s * delta_t; spike compensation: w -= lr (a v + b g');
  delay compensation: g + lambda g^2 (D_s delta_t) before the weight decay.
* B recomputes the stage's forward at the weights B reads (``checkpoint="always"`` in the
  pipeline), from the input the forward received; a later holder of the tied weight reads the
  owner's F value in its F and its B.
* Update j of every stage applies the mean gradient of micro-batches j*k .. j*k+k-1
  (momentum SGD in torch's convention, weight decay on the gradient); the owner's tied
  gradient is the sum of every holder's contribution.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call


def _versions(schedule: str, S: int, M: int, k: int, s: int, n: int) -> tuple[int, int]:
    w = S - 1 - s
    if schedule == "2bw":
        v = max(n // M - 1, 0)
        return v, v
    if schedule == "pipedream":
        t = max(n - w, 0) // k
        return t, t
    return max(n - 2 * w, 0) // k, n // k  # pb, dataflow order


def _spectrain(s: int, S: int) -> tuple[int, int]:
    return s // 2 + S - s - 1, s // 2


class TiedReference:
    """``modules``: the float32 stage modules at their initial values (deep-copied to
    float64); ``tie``: ((owner stage, name), [(stage, name), ...] later holders)."""

    def __init__(
        self,
        modules: list[nn.Module],
        tie: tuple[tuple[int, str], list[tuple[int, str]]],
        schedule: str,
        M: int,
        k: int,
        delays: list[int],
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        mitigation: str = "",
        decay: float = 0.1,
        dc: float = 0.0,
    ) -> None:
        self.mods = [copy.deepcopy(m).double() for m in modules]
        self.owner, self.later = tie
        self.S, self.schedule, self.M, self.k = len(modules), schedule, M, k
        self.D, self.lr, self.m, self.wd = delays, lr, momentum, weight_decay
        self.mitigation, self.decay, self.dc = mitigation, decay, dc
        later = {(s, n) for s, n in self.later}
        #: per stage: the history of its weights (dict name -> tensor) after t updates, the
        #: momentum buffer and the PipeMare delta after t updates
        self.w: list[list[dict[str, Tensor]]] = []
        for s, m in enumerate(self.mods):
            own = {n: p.detach().clone() for n, p in m.named_parameters() if (s, n) not in later}
            self.w.append([own])
        self.v: list[list[dict[str, Tensor] | None]] = [[None] for _ in range(self.S)]
        self.delta: list[list[dict[str, Tensor] | None]] = [[None] for _ in range(self.S)]
        self.grads: list[dict[str, Tensor]] = [self._zeros(s) for s in range(self.S)]
        self.n = 0
        self.skip: set[int] = set()  # update groups skipped (skip_update)

    def _zeros(self, s: int) -> dict[str, Tensor]:
        return {n: torch.zeros_like(p) for n, p in self.w[s][0].items()}

    # ------------------------------------------------------------------ weights read

    def _read(self, s: int, t: int, horizon: float, correct: bool) -> dict[str, Tensor]:
        w = self.w[s][t]
        if correct and self.delta[s][t] is not None:
            return {n: w[n] - self.D[s] * self.delta[s][t][n] for n in w}
        v = self.v[s][t]
        if horizon == 0 or v is None:
            return w
        return {n: w[n] - self.lr * horizon * v[n] for n in w}

    def _f_weights(self, s: int, t: int) -> dict[str, Tensor]:
        if self.mitigation == "lwp":
            return self._read(s, t, self.D[s], False)
        if self.mitigation == "spectrain":
            return self._read(s, t, _spectrain(s, self.S)[0], False)
        return self.w[s][t]

    def _b_weights(self, s: int, t: int) -> dict[str, Tensor]:
        if self.mitigation == "spectrain":
            return self._read(s, t, _spectrain(s, self.S)[1], False)
        if self.mitigation in ("t2", "t2dc"):
            return self._read(s, t, 0, True)
        return self.w[s][t]

    # ------------------------------------------------------------------ one micro-batch

    def microbatch(self, x: Tensor, y: Tensor, poisoned: bool = False) -> None:
        """One micro-batch in order; ``poisoned``: its loss is not finite, so every stage
        skips the update whose group holds it (on_nonfinite="skip_update")."""
        n, S = self.n, self.S
        if poisoned:
            self.skip.add(n // self.k)
            self.n += 1
            if self.n % self.k == 0:
                for s in range(S):
                    self._update(s)
            return
        vers = [_versions(self.schedule, S, self.M, self.k, s, n) for s in range(S)]
        (os_, oname) = self.owner
        tied = self._f_weights(os_, vers[os_][0])[oname]
        acts = []
        h: Any = x
        with torch.no_grad():
            for s in range(S):
                acts.append(h)
                h = functional_call(self.mods[s], self._with_tied(s, self._f_weights(s, vers[s][0]), tied), (h,))
        g_out: Tensor | None = None
        tied_leaf = tied.detach().clone().requires_grad_(True)
        for s in reversed(range(S)):
            pb = {n: t.detach().clone().requires_grad_(True) for n, t in self._b_weights(s, vers[s][1]).items()}
            xin = acts[s] if s == 0 else acts[s].detach().requires_grad_(True)
            out = functional_call(self.mods[s], self._with_tied(s, pb, tied_leaf), (xin,))
            if s == S - 1:
                nn.functional.cross_entropy(out, y).backward()
            else:
                out.backward(g_out)
            for name, p in pb.items():
                if p.grad is not None:
                    self.grads[s][name] += p.grad
            g_out = xin.grad if s > 0 else None
        self.grads[os_][oname] += tied_leaf.grad
        self.n += 1
        if self.n % self.k == 0:
            for s in range(S):
                self._update(s)

    def _with_tied(self, s: int, params: dict[str, Tensor], tied: Tensor) -> dict[str, Tensor]:
        names = [n for st, n in self.later if st == s]
        return {**params, **{n: tied for n in names}}

    # ------------------------------------------------------------------ updates

    def _update(self, s: int) -> None:
        w, v_old = self.w[s][-1], self.v[s][-1]
        if len(self.w[s]) - 1 in self.skip:  # weights and state unchanged; t advances
            self.w[s].append(w)
            self.v[s].append(v_old)
            self.delta[s].append(self.delta[s][-1])
            self.grads[s] = self._zeros(s)
            return
        new_w, new_v = {}, {}
        D = self.D[s]
        dc = self.mitigation.endswith("dc") and D > 0 and self.delta[s][-1] is not None
        for name, p in w.items():
            g = self.grads[s][name] / self.k
            if dc:  # delay compensation: g + lambda g^2 (D_s delta_t), before the decay
                g = g + self.dc * g * g * (D * self.delta[s][-1][name])
            g = g + self.wd * p
            v = g.clone() if v_old is None else self.m * v_old[name] + g
            if self.mitigation == "sc":
                a, b = self.m ** D, (1 - self.m ** D) / (1 - self.m)
                step = a * v + b * g
            else:
                step = v
            new_w[name], new_v[name] = p - self.lr * step, v
        self.w[s].append(new_w)
        self.v[s].append(new_v)
        if self.mitigation in ("t2", "dc", "t2dc") and D > 0:
            gamma = self.decay ** (1.0 / D)
            old = self.delta[s][-1]
            self.delta[s].append({
                n: (0 if old is None else gamma * old[n]) + (1 - gamma) * (new_w[n] - w[n]) for n in w
            })
        else:
            self.delta[s].append(None)
        self.grads[s] = self._zeros(s)

    def weights(self, s: int) -> dict[str, Tensor]:
        return self.w[s][-1]
