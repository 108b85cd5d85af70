"""Adam with basis rotation: Adam's per-coordinate adaptivity in the gradients' eigenbasis.

Why: Jung, Shin, Lee (ICML 2026, "Mitigating Staleness in Asynchronous Pipeline Parallelism
via Basis Rotation"; code joonkyoo/basis-rotation, ``optim/basis_rotation.py``) trace Adam's
sensitivity to delayed gradients to the misalignment of the coordinate basis with the
Hessian's eigenbasis, and run Adam in a basis rotated by running eigenvectors of the
gradient covariances G G^T and G^T G (SOAP's machinery), refreshed every T steps. The
rotation is matrix work (eigh, QR, matmuls per weight matrix), not an elementwise sweep of a
flat buffer, so this optimizer is a plain ``torch.optim.Optimizer`` over per-matrix tensors:
the pipeline runtime hands plain torch optimizers its arena's per-parameter views and steps
them through ``step()`` (``engine.runtime.stage.optim_bridge``), with no fused or flat path.

2-D parameters (``rotate`` on, both sides at most ``max_dim``) take the rotated update;
every other parameter (1-D, larger matrices, complex, zero-size, ``rotate=False`` groups)
takes AdamW: torch's fused AdamW kernel for fp32/fp64 parameters (one call per group and
device), torch's single-tensor AdamW op for op (``functional.adam_update``) for the others.
docs/ALGORITHMS.md ("Basis rotation") has the exact update and marks the choices that are
this project's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam

from engine.optim import functional
from engine.optim.options import is_real_number
from engine.optim.state_io import StateDictIO

__all__ = ["BasisRotation", "ROTATION_GEOMETRIES"]

#: "bi": rotate both sides (Q_L^T G Q_R); "uni": only the smaller side (the source's rule)
ROTATION_GEOMETRIES: tuple[str, ...] = ("bi", "uni")

#: state keys of a rotated parameter that are matrices of the rotation, not param-shaped
_ROTATION_KEYS = ("L", "R", "Q_L", "Q_R")


class BasisRotation(Optimizer):
    """Adam with Basis Rotation (the paper's Algorithm 1, ``S = 2nd``), AdamW elsewhere.

    ``betas``: Adam's (beta1, beta2). ``shampoo_beta``: the EMA coefficient of the
    covariances L and R (None: beta2, the source's default). ``precondition_frequency``: T,
    the eigenbases are refreshed at step 1 (eigh) and at every step t with t % T == 0 (one QR
    power iteration). ``rotation_geometry``: "bi" or "uni". ``max_dim``: a matrix with a side
    longer than this takes AdamW (its covariance would cost side^2 memory). ``rotate``: a
    group option; False sends the group's matrices to AdamW too. ``delay``: written by the
    pipeline (D_s); the update does not use it (the method needs no delay knowledge).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        shampoo_beta: float | None = None,
        precondition_frequency: int = 10,
        rotation_geometry: str = "bi",
        max_dim: int = 4096,
        rotate: bool = True,
        delay: int = 0,
    ) -> None:
        if isinstance(betas, list):
            betas = tuple(betas)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "shampoo_beta": shampoo_beta,
            "precondition_frequency": precondition_frequency,
            "rotation_geometry": rotation_geometry,
            "max_dim": max_dim,
            "rotate": rotate,
            "delay": delay,
        }
        _check_options(defaults, "")  # before torch stores anything
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ checks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, with the group's options checked before it is added."""
        if isinstance(param_group, dict):
            merged = {**getattr(self, "defaults", {}), **param_group}
            _check_options(merged, f"param_groups[{len(getattr(self, 'param_groups', []))}]: ")
        super().add_param_group(param_group)

    def _check_before_step(self) -> None:
        """Every check of a step, for every group, before any tensor changes."""
        for i, group in enumerate(self.param_groups):
            where = f"param_groups[{i}]: "
            _check_options(group, where)
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{where}params[{j}] has a sparse gradient; BasisRotation needs dense "
                        "gradients (use nn.Embedding(sparse=False))"
                    )
                state = self.state.get(p)
                if state:
                    rotated_state = any(k in state for k in _ROTATION_KEYS)
                    if rotated_state != self._rotated(group, p):
                        raise ValueError(
                            f"{where}params[{j}] ({tuple(p.shape)}) was stepped "
                            f"{'with' if rotated_state else 'without'} rotation, but the group's "
                            f"rotate={group['rotate']!r}/max_dim={group['max_dim']!r} now say "
                            "otherwise; its moments are in the other basis (keep the options, "
                            "or start a new optimizer)"
                        )

    @staticmethod
    def _rotated(group: dict[str, Any], p: Tensor) -> bool:
        """Whether ``p`` takes the rotated update (else AdamW)."""
        return (
            group["rotate"]
            and p.dim() == 2
            and p.numel() > 0
            and not torch.is_complex(p)
            and max(p.shape) <= group["max_dim"]
        )

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_before_step()
        for group in self.param_groups:
            plain = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self._rotated(group, p):
                    self._rotated_step(group, p)
                else:
                    plain.append(p)
            if plain:
                self._adamw_step(group, plain)
        return loss

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """AdamW for the parameters that are not rotated: torch's fused AdamW kernel over the
        fp32/fp64 ones of one device (one call instead of one per tensor: a model's many
        biases and norms made this half of the step's time), ``functional.adam_update`` (torch's
        single-tensor AdamW, op for op) for the others (fp32 state for bf16/fp16, complex)."""
        beta1, beta2 = group["betas"]
        lr = _number(group["lr"])
        fused: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = _zeros_like_state(p)
            if p.dtype in (torch.float32, torch.float64):  # sparse grads: refused before
                fused.setdefault((p.device, p.dtype), []).append(p)
                continue
            functional.adam_update(
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], None,
                step=state["step"], lr=lr, beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"], decoupled=True,
                amsgrad=False, maximize=False,
            )
        for ps in fused.values():
            states = [self.state[p] for p in ps]
            adam(
                ps, [p.grad for p in ps], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                fused=True, foreach=False, decoupled_weight_decay=True, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )

    def _rotated_step(self, group: dict[str, Any], p: Tensor) -> None:
        state = self.state[p]
        dtype = functional.state_dtype(p.dtype)
        rows, cols = p.shape
        left, right = _sides(group["rotation_geometry"], rows, cols)
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = _zeros_like_state(p)
            state["exp_avg_sq"] = _zeros_like_state(p)
            if left:
                state["L"] = torch.zeros(rows, rows, dtype=dtype, device=p.device)
            if right:
                state["R"] = torch.zeros(cols, cols, dtype=dtype, device=p.device)
        beta1, beta2 = group["betas"]
        beta_s = beta2 if group["shampoo_beta"] is None else group["shampoo_beta"]
        lr, eps, wd = _number(group["lr"]), group["eps"], group["weight_decay"]
        g = p.grad.to(dtype)
        state["step"] += 1
        t = int(state["step"])
        # 1. covariances (EMA of G G^T and G^T G)
        if left:
            state["L"].addmm_(g, g.T, beta=beta_s, alpha=1.0 - beta_s)
        if right:
            state["R"].addmm_(g.T, g, beta=beta_s, alpha=1.0 - beta_s)
        # 2. eigenbases: eigh at the first step, one QR power iteration every T steps
        if "Q_L" not in state and "Q_R" not in state:
            if left:
                state["Q_L"] = _eigenbasis(state["L"])
            if right:
                state["Q_R"] = _eigenbasis(state["R"])
        elif t % group["precondition_frequency"] == 0:
            if left:
                state["Q_L"] = _power_iteration(state, "L", "Q_L", 0)
            if right:
                state["Q_R"] = _power_iteration(state, "R", "Q_R", 1)
        q_l, q_r = state.get("Q_L"), state.get("Q_R")
        # 3. Adam in the rotated basis: m stays in the parameter's basis, v in the rotated one
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g, 1.0 - beta1)
        g_rot = _project(g, q_l, q_r)
        exp_avg_sq.mul_(beta2).addcmul_(g_rot, g_rot, value=1.0 - beta2)
        ratio = _project(exp_avg, q_l, q_r) / exp_avg_sq.sqrt().add_(eps)
        if q_r is not None:
            ratio = ratio @ q_r.T
        # 4. decoupled weight decay and the step (the source's bias correction), as one addmm
        step_size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
        w = p if p.dtype == dtype else p.to(dtype)
        if q_l is not None:
            w.addmm_(q_l, ratio, beta=1.0 - lr * wd, alpha=-step_size)
        else:
            w.mul_(1.0 - lr * wd).add_(ratio, alpha=-step_size)
        if w is not p:
            p.copy_(w)  # bf16/fp16 params: rounded once, math in fp32

    # ------------------------------------------------------------------ state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, with the state kept in fp32 for bf16/fp16 params (torch
        casts it to the param dtype) and the step count beside the param."""
        super().load_state_dict(state_dict)
        # the engine optimizers' conversion applies as is: it reads only groups and state
        StateDictIO._restore_state_dtypes(self, state_dict)  # type: ignore[arg-type]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state: ``moments`` (m, v: AdamW's too) and ``rotation`` (L, R,
        Q_L, Q_R: what basis rotation adds)."""
        out = {"moments": 0, "rotation": 0}
        for state in self.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    kind = "rotation" if key in _ROTATION_KEYS else "moments"
                    out[kind] += value.numel() * value.element_size()
        return out


# ---------------------------------------------------------------------- math


def _zeros_like_state(p: Tensor) -> Tensor:
    return torch.zeros_like(p, dtype=functional.state_dtype(p.dtype), memory_format=torch.contiguous_format)


def _number(x: Any) -> float:
    return float(x) if isinstance(x, Tensor) else x


def _sides(geometry: str, rows: int, cols: int) -> tuple[bool, bool]:
    """(rotate the rows with Q_L, rotate the columns with Q_R): both for "bi"; for "uni" the
    smaller side (rows when rows < cols, else columns), as the source decides."""
    if geometry == "bi":
        return True, True
    return rows < cols, rows >= cols


def _project(x: Tensor, q_l: Tensor | None, q_r: Tensor | None) -> Tensor:
    """Q_L^T X Q_R (a missing side is the identity)."""
    if q_l is not None:
        x = q_l.T @ x
    if q_r is not None:
        x = x @ q_r
    return x


def _eigenbasis(m: Tensor) -> Tensor:
    """Eigenvectors of the symmetric ``m``, columns by descending eigenvalue."""
    _, vectors = torch.linalg.eigh(m)
    return vectors.flip(1)


def _power_iteration(state: dict[str, Tensor], cov: str, basis: str, dim: int) -> Tensor:
    """One QR power iteration on ``state[cov]`` from ``state[basis]`` (SOAP's refresh).

    The columns are first sorted by their Rayleigh quotients diag(Q^T M Q), descending, and
    the second moment is permuted along ``dim`` to follow them (it lives in that basis)."""
    m, q = state[cov], state[basis]
    order = torch.argsort(torch.diagonal(q.T @ m @ q), descending=True, stable=True)
    state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)
    q, _ = torch.linalg.qr(m @ q[:, order])
    return q


# ---------------------------------------------------------------------- options


def _check_options(group: dict[str, Any], where: str) -> None:
    """Raise naming the option, its value and ``where`` (the group) when one is out of range."""
    lr = group["lr"]
    lr_value = float(lr) if isinstance(lr, Tensor) and lr.numel() == 1 else lr
    if not (is_real_number(lr_value) and lr_value >= 0.0):
        raise ValueError(f"{where}lr={lr!r} is invalid: the learning rate must be a number >= 0")
    betas = group["betas"]
    if not (isinstance(betas, tuple) and len(betas) == 2
            and all(is_real_number(b) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}betas={betas!r} is invalid: give (beta1, beta2), each a float in [0, 1)")
    sb = group["shampoo_beta"]
    if sb is not None and not (is_real_number(sb) and 0.0 <= sb < 1.0):
        raise ValueError(
            f"{where}shampoo_beta={sb!r} is invalid: the covariance EMA coefficient must lie in "
            "[0, 1), or be None (use beta2)"
        )
    for name in ("eps", "weight_decay"):
        if not (is_real_number(group[name]) and group[name] >= 0.0):
            raise ValueError(f"{where}{name}={group[name]!r} is invalid: it must be a float >= 0")
    for name, low in (("precondition_frequency", 1), ("max_dim", 1), ("delay", 0)):
        v = group[name]
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
            raise ValueError(f"{where}{name}={v!r} is invalid: it must be an int >= {low}")
    if group["rotation_geometry"] not in ROTATION_GEOMETRIES:
        raise ValueError(
            f"{where}rotation_geometry={group['rotation_geometry']!r} is invalid: use 'bi' "
            "(both sides) or 'uni' (the smaller side)"
        )
    if not isinstance(group["rotate"], bool):
        raise ValueError(f"{where}rotate={group['rotate']!r} is invalid: it must be True or False")
