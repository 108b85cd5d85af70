"""The layer profiler: measure each layer of an ``nn.Sequential`` on its own, once.

Why this is its own file: it is the only part of the package that runs a model, so it is the
part that depends on torch's devices, autograd hooks and timing, and the one to change when
measuring changes (CUDA events, other devices). It produces :class:`LayerCost` values and knows
nothing of schedules or the solver. Its byte accounting (distinct storages autograd saves,
parameters and buffers excluded, plus the output) is what the memory model in
:mod:`engine.partition.costs` calls activation bytes.

The layer is moved to the measuring device and back, and its buffers, ``.grad`` and the RNG
state are left as they were, so profiling does not disturb a model that is about to train.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from engine._checks import check_positive_int
from engine.partition.costs import LayerCost

__all__ = ["profile_layers", "save_profile", "load_profile", "model_fingerprint"]


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
    # a copy of its own: a micro-batch cut from a larger batch (x[:8]) is a view whose storage
    # is the whole batch, which the byte count (distinct storages) would charge to layer 0
    x: Tensor = sample.detach().to(dev).clone()
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


# ----------------------------------------------------------------------------- moving a layer and back


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


# ----------------------------------------------------------------------------- one layer


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


# ----------------------------------------------------------------------------- saved profiles

PROFILE_FORMAT = "engine.layer-profile/1"


def model_fingerprint(model: nn.Sequential) -> list[list[Any]]:
    """What a saved profile must match: each layer's type and parameter shapes and dtypes."""
    return [
        [type(layer).__name__, [[list(p.shape), str(p.dtype)] for p in layer.parameters()]]
        for layer in model
    ]


def save_profile(costs: list[LayerCost], model: nn.Sequential, path: str | os.PathLike[str],
                 *, repeats: int, device: str) -> None:
    """Write ``costs`` (from :func:`profile_layers`) as JSON, with the model's fingerprint, so
    that every rank and every rerun can cut at the same layers (atomically replaced)."""
    data = {
        "format": PROFILE_FORMAT,
        "fingerprint": model_fingerprint(model),
        "repeats": repeats,
        "device": device,
        "layers": [dataclasses.asdict(c) for c in costs],
    }
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def load_profile(model: nn.Sequential, path: str | os.PathLike[str]) -> list[LayerCost]:
    """The layer costs saved by :func:`save_profile`; ValueError when the file is not a
    profile or was measured on another model (layer types, parameter shapes or count)."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the layer profile {path!r}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path!r} is not a layer profile (format {got!r}, expected {PROFILE_FORMAT!r})")
    mine = model_fingerprint(model)
    theirs = data.get("fingerprint")
    if theirs != mine:
        n = len(theirs) if isinstance(theirs, list) else "?"
        first = next((k for k, (a, b) in enumerate(zip(mine, theirs or [], strict=False)) if a != b), None)
        where = f"; layer {first} differs ({theirs[first]} vs {mine[first]})" if first is not None else ""
        raise ValueError(
            f"the layer profile {path!r} was measured on another model ({n} layers vs "
            f"{len(mine)}{where}); delete it to profile this model"
        )
    try:
        return [LayerCost(**c) for c in data["layers"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the layer profile {path!r} is malformed: {exc}") from exc
