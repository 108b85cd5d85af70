"""Inputs of a step: the split into micro-batches and the dry-run check before anything runs.

Why a dry run: a wiring mistake (stage 1 expects 32 features, stage 0 outputs 16; targets of
the wrong dtype for the loss; inputs on the wrong device) would otherwise fail in the middle
of a step, after some stages ran. One micro-batch is pushed through every stage in eval mode
without autograd (no weight, buffer or RNG state changes), and any failure is reported naming
both stages and the shapes. The check runs once per *key* -- everything that can change the
outcome: the structure of the inputs and targets and every tensor leaf's per-sample shape,
dtype and device, and the value of switches (bool, str, None leaves; other constants by type
only, so a number that changes every step does not re-run it) -- so a later batch on another
device, with float targets or with a flag flipped is checked again instead of failing
mid-step.

``describe`` and ``first_layer_expectation`` are shared with the multi-process handshake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine.errors import PipelineInputError
from engine.runtime.stage import trees

__all__ = ["split", "input_key", "dry_run", "describe", "first_layer_expectation"]


def describe(module: nn.Module) -> str:
    return type(module).__name__


def first_layer_expectation(module: nn.Module) -> str:
    """' (its first layer Linear expects in_features=8)' when the first leaf says so."""
    for name, sub in module.named_modules():
        for attr in ("in_features", "in_channels", "num_features", "normalized_shape", "embedding_dim"):
            if hasattr(sub, attr) and not list(sub.children()):
                return (
                    f" (its first layer {name or type(sub).__name__} ({type(sub).__name__}) "
                    f"expects {attr}={getattr(sub, attr)})"
                )
    return ""


def split(
    inputs: Any, targets: Any, chunks: int, *, read_inputs: bool = True
) -> tuple[list[Any], list[Any], list[int]]:
    """``chunks`` equal micro-batches of ``inputs`` (and ``targets``) along dim 0, and their
    sample counts. Either may be a tree (engine.runtime.stage.trees): every tensor leaf is split on
    dim 0, every other leaf is passed to each micro-batch as it is. ``read_inputs=False`` (a
    rank that only computes the loss): the batch size comes from the targets; xs are None."""
    if not read_inputs or not isinstance(inputs, Tensor) or _tree(targets):
        return _split_trees(inputs if read_inputs else None, targets, chunks, read_inputs)
    if inputs.dim() == 0:
        raise PipelineInputError("inputs is a scalar; it needs a batch dimension (dim 0)")
    B = int(inputs.shape[0])
    if isinstance(targets, Tensor) and (targets.dim() == 0 or int(targets.shape[0]) != B):
        raise PipelineInputError(
            f"targets have shape {tuple(targets.shape)} but inputs have {B} samples; dim 0 must match"
        )
    _check_batch(B, chunks)
    b = B // chunks
    xs = list(inputs.split(b))
    ts = list(targets.split(b)) if isinstance(targets, Tensor) else [targets] * chunks
    return xs, ts, [b] * chunks


def _tree(x: Any) -> bool:
    return isinstance(x, (tuple, list, dict)) and not isinstance(x, torch.Size)


def _split_trees(
    inputs: Any, targets: Any, chunks: int, read_inputs: bool
) -> tuple[list[Any], list[Any], list[int]]:
    leaves = trees.with_paths(targets, "targets")
    if read_inputs:
        leaves = trees.with_paths(inputs, "inputs") + leaves
    ref: tuple[str, int] | None = None
    for path, leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.dim() == 0:
                raise PipelineInputError(
                    f"{path} is a scalar tensor; every tensor leaf needs the batch on dim 0 "
                    "(pass a value shared by all samples as a Python number)"
                )
            n = int(leaf.shape[0])
            if ref is None:
                if read_inputs and not path.startswith("inputs"):
                    break
                ref = (path, n)
            elif n != ref[1]:
                raise PipelineInputError(
                    f"{path} has {n} samples on dim 0, {ref[0]} has {ref[1]}; every tensor leaf "
                    "of inputs and targets needs the same batch size on dim 0"
                )
        elif trees.unknown_container(leaf):
            raise PipelineInputError(
                f"{path} is a {type(leaf).__name__}; use a tuple, list or dict (or a namedtuple "
                "or OrderedDict) so that its tensors are split into micro-batches"
            )
    if ref is None:
        what = "inputs" if read_inputs else "targets"
        raise PipelineInputError(
            f"{what} hold no tensor: pass a tensor, or a tuple/list/dict of tensors, with the "
            f"batch on dim 0 (got {trees.describe(inputs if read_inputs else targets)})"
        )
    B = ref[1]
    _check_batch(B, chunks)
    b = B // chunks
    xs = _chunks(inputs, b, chunks) if read_inputs else [None] * chunks
    return xs, _chunks(targets, b, chunks), [b] * chunks


def _chunks(tree: Any, b: int, chunks: int) -> list[Any]:
    if isinstance(tree, Tensor):
        return list(tree.split(b))
    leaves, spec = trees.flatten(tree)
    parts = [x.split(b) if isinstance(x, Tensor) else None for x in leaves]
    return [
        trees.unflatten([p[k] if p is not None else x for x, p in zip(leaves, parts, strict=True)], spec)
        for k in range(chunks)
    ]


def _check_batch(B: int, chunks: int) -> None:
    if B == 0:
        raise PipelineInputError("the batch is empty (0 samples); pass at least chunks samples")
    if B % chunks != 0:
        divisors = [d for d in range(1, B + 1) if B % d == 0]
        sizes = sorted({max(chunks, B - B % chunks), B + chunks - B % chunks})
        raise PipelineInputError(
            f"a batch of {B} samples cannot be split into chunks={chunks} equal micro-batches; use "
            f"a batch size divisible by {chunks} (e.g. {' or '.join(map(str, sizes))}), or "
            f"chunks in {divisors}"
        )


def _key_of(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape[1:]), value.dtype, value.device)
    return trees.key(value)


def input_key(x: Any, target: Any) -> tuple[Any, Any]:
    """What the dry-run result depends on (module docstring; trees.key for trees)."""
    return (_key_of(x), _key_of(target))


def checked_loss(stage: int, loss_fn: Any, out: Any, target: Any) -> Tensor:
    """``loss_fn(out, target)``; an IndexError (torch's cross_entropy: "Target 11 is out of
    bounds.", a class label >= C or < 0) becomes a PipelineInputError naming the stage and
    the micro-batch (labels.CURRENT) instead of torch's bare message."""
    try:
        return loss_fn(out, target)  # type: ignore[no-any-return]
    except IndexError as exc:
        from engine.runtime.stage import labels

        where = labels.CURRENT
        mb = f"micro-batch {where[1]}" if where is not None else "a micro-batch"
        classes = f" of the {out.shape[-1]} classes of its output" if isinstance(out, Tensor) and out.dim() else ""
        raise PipelineInputError(
            f"stage {stage}'s loss_fn failed on {mb}: IndexError: {exc}. A target (class "
            f"label) is outside the range{classes} (labels must be in [0, C)); check the "
            "targets or the last stage's output size"
        ) from exc


def one_dim_hint(h: Any) -> str:
    """Why a 1-D micro-batch may be a mistake: the batch is dim 0, so a 1-D input of N values
    is N samples of no features (one sample needs a batch dimension)."""
    if isinstance(h, Tensor) and h.dim() == 1:
        return (
            ". The inputs are 1-D: dim 0 is the batch, so each value was read as one sample; "
            "for a single sample of features add a batch dimension (x.unsqueeze(0))"
        )
    return ""


def stage_input_error(s: int, mod: nn.Module, h: Any, exc: Exception) -> PipelineInputError:
    """The error for stage ``s`` failing on its input ``h``: names the stage, the shape, what
    its first layer expects and, past stage 0, the stage whose output it was."""
    shape = trees.describe(h)
    if s == 0:
        return PipelineInputError(
            f"stage 0 ({describe(mod)}) cannot run on an input micro-batch of "
            f"shape {shape}{first_layer_expectation(mod)}: {exc}{one_dim_hint(h)}"
        )
    return PipelineInputError(
        f"stage {s - 1} outputs shape {shape} but stage {s} ({describe(mod)}) "
        f"cannot take it as input{first_layer_expectation(mod)}: {exc}. Make stage "
        f"{s - 1}'s output match stage {s}'s input (layer sizes or balance)."
    )


def dry_run(
    modules: Sequence[nn.Module],
    x: Any,
    target: Any,
    loss_fn: Callable[[Tensor, Any], Tensor],
) -> None:
    """Run one micro-batch through ``modules`` (stage 0 first) in eval mode without grad and
    check the loss; raise PipelineInputError naming the stage(s) on failure. Training modes
    and the CPU (and CUDA) RNG state are restored."""
    modes = [[m.training for m in mod.modules()] for mod in modules]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        for mod in modules:
            mod.eval()
        h = x
        with torch.no_grad():
            for s, mod in enumerate(modules):
                try:
                    out = mod(h) if isinstance(h, Tensor) else trees.call(mod, h)
                except Exception as exc:  # a wiring error: teach the fix
                    raise stage_input_error(s, mod, h, exc) from exc
                problem = trees.check_output(out, f"stage {s}") if s < len(modules) - 1 else ""
                if problem:
                    raise PipelineInputError(problem)
                h = out
            try:
                loss = loss_fn(h, target)
            except Exception as exc:
                tshape = trees.describe(target) if _tree(target) or isinstance(target, Tensor) else repr(target)
                raise PipelineInputError(
                    f"loss_fn cannot compare the last stage's output of shape {trees.describe(h)} "
                    f"with targets {tshape}"
                    + (f" ({target.dtype} on {target.device})" if isinstance(target, Tensor) else "")
                    + f": {exc}"
                ) from exc
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise PipelineInputError(
                    "loss_fn must return a scalar tensor (the mean over the micro-batch's "
                    f"samples), got {got}"
                )
    finally:
        for mod, flags in zip(modules, modes, strict=True):
            for m, flag in zip(mod.modules(), flags, strict=True):
                m.training = flag
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
