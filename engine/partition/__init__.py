"""Automatic partitioning: profile the layers of an ``nn.Sequential``, then split it into
pipeline stages that are as fast (``balance="time"``) or as small (``balance="memory"``) as
possible while every stage fits a memory cap.

Why this module exists, and why it looks the way it does:

* A pipeline runs at the speed of its slowest stage, and a hand-typed ``balance=[...]`` is
  easily unbalanced or over a device's memory. Profiling each layer once and solving the
  split exactly takes well under a second for hundreds of layers and removes the guesswork.
* What a stage holds depends on the **schedule** and on the stage's **position**: PipeDream
  stashes S-s weight versions at stage s, 2BW keeps two, GPipe keeps the activations of all M
  micro-batches while 1F1B keeps at most S-s, and pipelined backprop (dataflow order) keeps
  2(S-1-s)+1. A partitioner that ignores this puts too many layers on stage 0 and runs out of
  memory exactly where it matters. :func:`stage_footprint` gives these counts; they are the
  steady-state values of ALGORITHMS.md, and ``tests/test_partition.py`` checks them against
  :func:`engine.schedule.analyze`, which measures them by simulating the generated schedules.
  For the asynchronous schedules (pipedream, 2bw, pb) the pipeline stays full across
  mini-batches, so the count does not shrink with small M (PipeDream keeps S-s micro-batches
  and versions in flight even with M = 1); the synchronous ones flush every mini-batch, so
  1F1B holds min(M, S-s) and GPipe M.
* The solver is exact, not greedy (see :func:`partition`): dynamic programming over prefix
  sums, O(S * n^2) for n layers and S stages. Times are converted to exact integers (every
  float is a dyadic rational, so scaling by the largest denominator is lossless) and memory is
  counted in whole bytes, so comparisons never depend on floating-point summation order, and
  a brute force over all splits finds exactly the same answer (the tests check this).

Memory of stage s holding layers i..j-1 (``P`` parameter bytes, ``Buf`` buffer bytes, ``A``
activation bytes of one micro-batch, all summed over the layers)::

    memory = P * (versions_s + 1 gradient) + ceil(P * optimizer_state_factor) + Buf
             + A * activations_s

``optimizer_state_factor`` counts optimizer buffers per parameter element of the same dtype:
0 for plain SGD, 1 for SGD with momentum, 2 for Adam/AdamW (the default: a safe upper bound);
add 1 for PipeMare's discrepancy-correction delta or a materialised weight prediction.
Activation bytes per layer are the tensors autograd saves for backward (parameters excluded,
shared storage counted once) plus the layer's output; summing them over a stage is an upper
bound (a layer's output is often also what the next layer saves), which is the safe side
for a cap.

Tie-break (deterministic): among the splits that minimise the objective, take the one that
minimises the other quantity's maximum (``"time"``: the least peak stage memory;
``"memory"``: the least bottleneck time); among those, the lexicographically smallest balance,
i.e. the fewest layers on the earliest stages, which under 1F1B/PipeDream/pb are the stages
that hold the most versions and activations.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine._checks import check_positive_int
from engine.partition.costs import (
    OPTIMIZER_STATE_FACTORS,
    LayerCost,
    StageCost,
    _check_balance,
    _optimizer_factor,
    stage_costs,
)
from engine.partition.footprint import SCHEDULES, stage_footprint
from engine.partition.solver import OBJECTIVES, _check_cap, partition

__all__ = [
    "OBJECTIVES",
    "OPTIMIZER_STATE_FACTORS",
    "SCHEDULES",
    "LayerCost",
    "StageCost",
    "balance_model",
    "partition",
    "profile_layers",
    "split_sequential",
    "stage_costs",
    "stage_footprint",
]


# ----------------------------------------------------------------------------- profiling


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None
    return st.data_ptr(), st.nbytes()


def _tensor_bytes(t: Tensor) -> int:
    key = _storage_key(t)
    return key[1] if key is not None else t.numel() * t.element_size()


def profile_layers(
    model: nn.Sequential,
    sample: Tensor,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
) -> list[LayerCost]:
    """Measure each layer of ``model`` on its own: forward time, backward time, parameter,
    buffer and activation bytes, per micro-batch.

    ``sample`` is one micro-batch as the pipeline will see it (the mini-batch divided by
    ``chunks``). Layer k runs on the (detached) output of layer k-1, which requires grad
    (layer 0's input only if ``sample`` does), and its backward computes the gradients of its
    parameters and input for an output gradient of ones, through ``torch.autograd.grad`` so
    that no ``.grad`` is touched. After two warm-up runs, each time is the median of
    ``repeats`` runs, CUDA-synchronised on a GPU. Activation bytes: the distinct storages
    autograd saves during the forward (``saved_tensors_hooks``), parameters and buffers
    excluded, plus the output's storage.

    ``device``: where to measure (default: where ``sample`` is). Each layer is moved there for
    its measurement and back afterwards; buffers (e.g. BatchNorm running statistics), ``.grad``
    and the RNG state are left as they were. Layers run in training mode.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"profile_layers needs an nn.Sequential, got {type(model).__name__}")
    if len(model) == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers to profile")
    if not isinstance(sample, Tensor):
        raise TypeError(f"sample must be a tensor (one micro-batch), got {type(sample).__name__}")
    repeats = check_positive_int("repeats", repeats, "measure at least once")
    dev = torch.device(device) if device is not None else sample.device
    x: Tensor = sample.detach().to(dev)
    x.requires_grad_(sample.requires_grad)
    out_costs: list[LayerCost] = []
    rng_devices = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        for k, (name, layer) in enumerate(model.named_children()):
            out_costs.append(_profile_one(k, name, layer, x, dev, repeats))
            with torch.no_grad():
                training = layer.training
                layer.train()
                home = _move(layer, dev)
                try:
                    y = layer(x)
                finally:
                    layer.train(training)
                    _restore(layer, home)
            x = y.detach()
            x.requires_grad_(x.is_floating_point() or x.is_complex())
    return out_costs


def _move(layer: nn.Module, dev: torch.device) -> dict[str, tuple[torch.device, Tensor]]:
    """Snapshot buffers and grads and move ``layer`` to ``dev``; :func:`_restore` undoes it."""
    home: dict[str, tuple[torch.device, Tensor]] = {}
    for bname, b in layer.named_buffers():
        home["b:" + bname] = (b.device, b.detach().clone())
    for pname, p in layer.named_parameters():
        home["p:" + pname] = (p.device, p.grad)  # type: ignore[assignment]
    layer.to(dev)
    return home


def _restore(layer: nn.Module, home: dict[str, tuple[torch.device, Tensor]]) -> None:
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    for key, (where, saved) in home.items():
        kind, name = key[:2], key[2:]
        if kind == "p:":
            p = params[name]
            p.data = p.data.to(where)
            p.grad = saved
        else:
            b = buffers[name]
            b.data = saved.to(where)


def _profile_one(
    k: int, name: str, layer: nn.Module, x: Tensor, dev: torch.device, repeats: int
) -> LayerCost:
    params = [p for p in layer.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in layer.buffers())
    label = f"{name}: {type(layer).__name__}"
    training = layer.training
    home = _move(layer, dev)
    try:
        layer.train()
        excluded = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        excluded |= {b.untyped_storage().data_ptr() for b in layer.buffers()}
        trainable = [p for p in layer.parameters() if p.requires_grad]
        inputs = ([x] if x.requires_grad else []) + trainable

        def forward(record: dict[int, int] | None) -> Tensor:
            if record is None:
                y = layer(x)
            else:

                def pack(t: Tensor) -> Tensor:
                    key = _storage_key(t)
                    if key is not None and key[0] not in excluded:
                        record[key[0]] = max(record.get(key[0], 0), key[1])
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = layer(x)
            if not isinstance(y, Tensor):
                raise TypeError(
                    f"layer {k} ({label}) returned a {type(y).__name__}; partitioning needs "
                    "every layer of the nn.Sequential to return one tensor"
                )
            return y

        def backward(y: Tensor) -> None:
            if y.requires_grad and inputs:
                torch.autograd.grad(y, inputs, torch.ones_like(y), allow_unused=True)

        for _ in range(2):  # warm-up (allocator, kernel selection, lazy init)
            backward(forward(None))
        _sync(dev)
        saved: dict[int, int] = {}
        fwd_times, bwd_times = [], []
        for r in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            y = forward(saved if r == 0 else None)
            _sync(dev)
            t1 = time.perf_counter()
            backward(y)
            _sync(dev)
            t2 = time.perf_counter()
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1 if y.requires_grad and inputs else 0.0)
            if r == 0:
                okey = _storage_key(y)
                if okey is None:
                    saved[-1] = _tensor_bytes(y)
                else:
                    saved[okey[0]] = max(saved.get(okey[0], 0), okey[1])
            del y
    finally:
        layer.train(training)
        _restore(layer, home)
    return LayerCost(
        forward_time=statistics.median(fwd_times),
        backward_time=statistics.median(bwd_times),
        param_bytes=param_bytes,
        activation_bytes=sum(saved.values()),
        buffer_bytes=buffer_bytes,
        name=label,
    )


# ----------------------------------------------------------------------------- model level


def split_sequential(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into ``len(balance)`` consecutive ``nn.Sequential`` stages.

    The stages share the original modules (no copies) and keep their names, so a stage's
    ``state_dict`` keys are the model's (``"3.weight"`` stays ``"3.weight"``).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    bal = _check_balance(balance, len(model), what="layers")
    children = list(model.named_children())
    out, i = [], 0
    for n in bal:
        out.append(nn.Sequential(OrderedDict(children[i : i + n])))
        i += n
    return out


def balance_model(
    model: nn.Sequential,
    sample: Tensor,
    stages: int,
    *,
    balance: str | Sequence[int] = "time",
    schedule: str,
    chunks: int,
    memory_cap_bytes: float | None = None,
    optimizer_state_factor: float | str = 2,
    order: str | None = None,
    device: torch.device | str | None = None,
    repeats: int = 3,
) -> list[int]:
    """Profile ``model`` on ``sample`` (one micro-batch) and return the optimal balance.

    ``balance="time"`` or ``"memory"`` picks the objective (see :func:`partition`); a list is
    validated against the model and returned unchanged.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"balance_model needs an nn.Sequential, got {type(model).__name__}")
    if not isinstance(balance, str):
        bal = _check_balance(balance, len(model), what="layers")
        if len(bal) != stages:
            raise ValueError(f"balance {bal} has {len(bal)} stages but stages={stages}")
        return bal
    if balance not in OBJECTIVES:
        raise ValueError(
            f"unknown balance {balance!r}; use 'time', 'memory' or a list of layer counts"
        )
    # fail on bad arguments before spending time profiling
    S = check_positive_int("stages", stages, "a pipeline needs at least one stage")
    if S > len(model):
        raise ValueError(
            f"cannot split {len(model)} layers into {S} stages; use at most {len(model)} stages "
            "or split layers"
        )
    stage_footprint(schedule, S, chunks, order=order)
    _optimizer_factor(optimizer_state_factor)
    _check_cap(memory_cap_bytes)
    costs = profile_layers(model, sample, device=device, repeats=repeats)
    return partition(
        costs,
        S,
        objective=balance,
        schedule=schedule,
        chunks=chunks,
        memory_cap_bytes=memory_cap_bytes,
        optimizer_state_factor=optimizer_state_factor,
        order=order,
    )
