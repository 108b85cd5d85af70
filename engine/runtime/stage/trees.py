"""Tensor trees between stages: what a stage takes and returns, and how the runtime walks it.

A stage returns a tensor, or a tree: tuples (namedtuples too), lists and dicts (OrderedDict
too) nested in any way, whose leaves are tensors or constants (``CONSTANTS``: None, numbers,
strings, dtypes, devices, sizes). The next stage's module is called with the tree by one
rule (:func:`call`): a tuple is passed as positional arguments (``module(*out)``), a dict as
keyword arguments (``module(**out)``), anything else -- a tensor, a list -- as one argument.

Gradients travel only where they mean something: a tensor leaf carries a gradient back when
it requires grad at the producer (a floating tensor computed from the stage's weights or from
an input that requires grad). Integer token ids, boolean masks, position ids and floating
tensors that need no gradient travel with the activations and get none, so the consumer's
input gradients (:func:`input_grads`) and the producer's backward roots (:func:`grad_roots`)
are the same list of leaves, in the same order.

Why a flattener of our own rather than ``torch.utils._pytree``: it knows exactly these
containers (an unknown container in a tree would otherwise become an opaque leaf and not be
split or sent), it names leaves by path for error messages, and it is faster for the small
trees stages pass (docs/design-notes.md), on a path that runs for every micro-batch at every stage. A single
tensor never enters this module: the runtime keeps its fast path.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "CONSTANTS",
    "LeafMeta",
    "Signature",
    "call",
    "check_output",
    "describe",
    "flatten",
    "grad_roots",
    "input_grads",
    "key",
    "map_tensors",
    "stage_input",
    "tensors",
    "unflatten",
    "unknown_container",
    "with_paths",
]

#: non-tensor leaves a stage may pass on (compared by value under gloo/NCCL, where they are
#: sent once, at the handshake)
CONSTANTS: tuple[type, ...] = (
    type(None), bool, int, float, complex, str, bytes,
    torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format,
)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _container(x: Any) -> bool:
    t = type(x)
    return t is tuple or t is list or t is dict or t is OrderedDict or _is_namedtuple(x)


def unknown_container(x: Any) -> bool:
    """A tuple/list/dict subclass the runtime cannot rebuild (it would hide tensors)."""
    return isinstance(x, (tuple, list, dict)) and not _container(x) and not isinstance(x, torch.Size)


# ---------------------------------------------------------------------- flatten / rebuild


def _flat(x: Any, leaves: list[Any]) -> Any:
    t = type(x)
    if t is tuple or t is list:
        return (t, None, tuple([_flat(c, leaves) for c in x]))
    if t is dict or t is OrderedDict:
        return (t, tuple(x), tuple([_flat(v, leaves) for v in x.values()]))
    if _is_namedtuple(x):
        return (t, None, tuple([_flat(c, leaves) for c in x]))
    leaves.append(x)
    return None


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """(leaves in order, spec); ``unflatten(leaves, spec)`` rebuilds the tree. Specs of two
    trees are equal when their containers, dict keys (in order) and lengths are."""
    leaves: list[Any] = []
    spec = _flat(tree, leaves)
    return leaves, spec


def _build(spec: Any, it: Iterator[Any]) -> Any:
    if spec is None:
        return next(it)
    t, keys, children = spec
    values = [_build(c, it) for c in children]
    if t is list:
        return values
    if t is tuple:
        return tuple(values)
    if keys is not None:
        return t(zip(keys, values, strict=True))
    return t(*values)  # a namedtuple


def unflatten(leaves: list[Any], spec: Any) -> Any:
    return _build(spec, iter(leaves))


def map_tensors(fn: Callable[[Tensor], Any], tree: Any) -> Any:
    """The tree with ``fn`` applied to every tensor leaf (other leaves kept as they are)."""
    leaves, spec = flatten(tree)
    return unflatten([fn(x) if isinstance(x, Tensor) else x for x in leaves], spec)


def tensors(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    return [x for x in flatten(tree)[0] if isinstance(x, Tensor)]


def with_paths(tree: Any, root: str) -> list[tuple[str, Any]]:
    """Every leaf with its path, e.g. ``("inputs['mask']", tensor)``, in flatten order."""
    out: list[tuple[str, Any]] = []

    def walk(x: Any, path: str) -> None:
        t = type(x)
        if t is dict or t is OrderedDict:
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
        elif t is tuple or t is list or _is_namedtuple(x):
            for i, c in enumerate(x):
                walk(c, f"{path}[{i}]")
        else:
            out.append((path, x))

    walk(tree, root)
    return out


# ---------------------------------------------------------------------- stages


def call(module: nn.Module | Callable[..., Any], x: Any) -> Any:
    """The calling convention: a tuple is positional arguments, a dict keyword arguments,
    anything else (a tensor, a list) one argument."""
    if isinstance(x, tuple) and not isinstance(x, torch.Size):
        return module(*x)
    if isinstance(x, dict):
        return module(**x)
    return module(x)


def check_output(out: Any, who: str) -> str:
    """Why ``out`` cannot be passed to the next stage ("" when it can); ``who`` names it,
    e.g. "stage 1"."""
    if isinstance(out, Tensor):
        return ""
    hint = (
        "; a stage returns a tensor, or a tuple/list/dict of tensors and constants (None, "
        "bool, int, float, str, dtype, device), nested as needed"
    )
    if not _container(out):
        return f"{who} returned {type(out).__name__}{hint}"
    if isinstance(out, dict) and not all(isinstance(k, str) for k in out):
        bad = next(k for k in out if not isinstance(k, str))
        return (
            f"{who} returned a dict with the key {bad!r}: a dict output is passed to the next "
            "stage as keyword arguments, so its keys must be strings"
        )
    found = False
    for path, leaf in with_paths(out, "output"):
        if isinstance(leaf, Tensor):
            found = True
        elif not isinstance(leaf, CONSTANTS) or unknown_container(leaf):
            return f"{who}'s {path} is a {type(leaf).__name__}{hint}"
    if not found:
        return f"{who} returned {describe(out)}, which holds no tensor{hint}"
    return ""


def detached_copy(tree: Any) -> tuple[Any, list[bool]]:
    """(a copy of ``tree`` with detached tensor leaves, each leaf's requires_grad flag in
    leaf order): what a saved state holds of a tree in flight (no graph, no aliasing)."""
    return map_tensors(lambda t: t.detach().clone(), tree), [t.requires_grad for t in tensors(tree)]


def grad_flags_mismatch(tree: Any, flags: Any) -> str:
    """Why ``flags`` cannot be :func:`detached_copy`'s flags of ``tree`` ("" if they can)."""
    n = len(tensors(tree))
    if not isinstance(flags, list) or len(flags) != n:
        return f"{len(flags) if isinstance(flags, list) else flags!r} gradient flags for {n} tensors"
    return ""


def with_grad_flags(tree: Any, flags: list[bool]) -> Any:
    """Undo :func:`detached_copy`: fresh tensor leaves with the saved requires_grad flags."""
    problem = grad_flags_mismatch(tree, flags)
    if problem:
        raise ValueError(problem)
    it = iter(flags)
    return map_tensors(lambda t: t.clone().requires_grad_(bool(next(it))), tree)


def stage_input(x: Any, grads: bool) -> Any:
    """A stage's own leaves for its input tree (the producer's output, graph attached):
    gradients land in them where ``grads`` and the producer's leaf requires grad."""
    return map_tensors(lambda t: t.detach().requires_grad_(grads and t.requires_grad), x)


def input_grads(xin: Any) -> list[Tensor]:
    """The gradients to send back: one per input leaf that requires grad, in leaf order (zeros
    where the stage did not use the leaf)."""
    return [
        t.grad if t.grad is not None else torch.zeros_like(t)
        for t in tensors(xin)
        if t.requires_grad
    ]


def input_gradient(xin: Any) -> Any:
    """What a stage sends back for its input ``xin``: a tensor input's gradient (zeros when
    unused; None when it requires none), or a tree's :func:`input_grads`."""
    if not isinstance(xin, Tensor):
        return input_grads(xin)  # one per leaf that requires grad (maybe none)
    if not xin.requires_grad:
        return None
    return xin.grad if xin.grad is not None else torch.zeros_like(xin)


def grad_roots(out: Any) -> list[Tensor]:
    """The output leaves a backward starts from: those that require grad."""
    return [t for t in tensors(out) if t.requires_grad]


# ---------------------------------------------------------------------- words and keys


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(tree: Any) -> str:
    """Shapes in words: ``(2, 6)`` for a tensor, ``([0] (2, 6) float32, [1] (2, 5) int64)``
    for a tree."""
    if isinstance(tree, Tensor):
        return str(tuple(tree.shape))
    if isinstance(tree, LeafMeta):
        return str(tree.shape)
    if not _container(tree):
        return type(tree).__name__
    parts = []
    for path, leaf in with_paths(tree, ""):
        if isinstance(leaf, Tensor):
            parts.append(f"{path} {tuple(leaf.shape)} {_dtype(leaf.dtype)}")
        elif isinstance(leaf, LeafMeta):
            parts.append(f"{path} {leaf.shape} {_dtype(leaf.dtype)}")
        else:
            parts.append(f"{path} {leaf!r}"[:80])
    return "(" + ", ".join(parts) + ")"


#: constants whose value is part of a dry-run key: switches (a causal flag, a mode name), not
#: numbers, which may change every step (a temperature) and would re-run the check each time
_KEYED_VALUES = (bool, str, type(None), torch.dtype, torch.device)


def key(tree: Any) -> Any:
    """What a dry run's outcome depends on: the structure and, per leaf, a tensor's per-sample
    shape, dtype and device, a switch's value (bool, str, None, dtype, device), or the type
    of any other constant."""
    leaves, spec = flatten(tree)
    out: list[Any] = [spec]
    for x in leaves:
        if isinstance(x, Tensor):
            out.append(("T", tuple(x.shape[1:]), x.dtype, x.device))
        elif isinstance(x, _KEYED_VALUES):
            out.append(("V", type(x), x))
        else:
            out.append(("V", type(x)))
    return tuple(out)


# ---------------------------------------------------------------------- the wire (gloo/NCCL)


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """A tensor leaf as agreed at the handshake."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class Signature:
    """What a channel carries per micro-batch, agreed once at the first step's handshake: the
    tree's structure and constants, and every tensor leaf's path, shape, dtype and whether it
    carries a gradient. Built from a tree (:meth:`of`) or from the skeleton another rank sent
    (the tree with :class:`LeafMeta` in place of its tensors)."""

    def __init__(self, skeleton: Any) -> None:
        self.skeleton = skeleton
        self.single = isinstance(skeleton, LeafMeta)
        self.leaves, self.spec = flatten(skeleton)
        self.paths = [p for p, _ in with_paths(skeleton, "")]
        self.tensor_at = [i for i, x in enumerate(self.leaves) if isinstance(x, LeafMeta)]
        self.grad_at = [i for i in self.tensor_at if self.leaves[i].requires_grad]

    @classmethod
    def of(cls, tree: Any) -> Signature:
        return cls(
            map_tensors(lambda t: LeafMeta(tuple(t.shape), t.dtype, t.requires_grad), tree)
        )

    def metas(self, grad: bool) -> list[tuple[str, LeafMeta]]:
        """(path, meta) of the tensors sent per micro-batch: all of them, or (``grad``) those
        carrying a gradient."""
        return [(self.paths[i], self.leaves[i]) for i in (self.grad_at if grad else self.tensor_at)]

    def mismatch(self, value: Any) -> str:
        """Why an activation tree does not fit the agreement ("" when it does)."""
        if self.single:
            if not isinstance(value, Tensor):
                return f"a {type(value).__name__} instead of one tensor"
            return _leaf_mismatch("", value, self.leaves[0])
        leaves, spec = flatten(value)
        if spec != self.spec:
            return f"{describe(value)} instead of the agreed structure {describe(self.skeleton)}"
        for path, got, want in zip(self.paths, leaves, self.leaves, strict=True):
            if isinstance(want, LeafMeta):
                if not isinstance(got, Tensor):
                    return f"{path} is a {type(got).__name__} instead of a tensor"
                why = _leaf_mismatch(path, got, want)
                if why:
                    return why
            elif type(got) is not type(want) or (got is not want and got != want):
                return (
                    f"the non-tensor leaf {path} is {got!r} instead of {want!r}: non-tensor "
                    "leaves are sent once, at the handshake, so they must not change (make it a "
                    "tensor with the batch on dim 0 if it varies)"
                )
        return ""

    def grad_mismatch(self, grads: list[Tensor]) -> str:
        """Why the input gradients of a micro-batch do not fit the agreement ("" when they do)."""
        metas = self.metas(grad=True)
        if len(grads) != len(metas):
            return f"{len(grads)} gradients instead of {len(metas)}"
        for (path, want), got in zip(metas, grads, strict=True):
            why = _leaf_mismatch(path, got, want, grad=True)
            if why:
                return why
        return ""

    def reshaped(self, value: Any) -> Signature | None:
        """The Signature of the activation ``value`` if it differs from this one in tensor
        shapes only (same structure, constants, dtypes and requires_grad), else None."""
        new = Signature.of(value)
        if new.spec != self.spec:
            return None
        for got, want in zip(new.leaves, self.leaves, strict=True):
            if isinstance(want, LeafMeta):
                if not isinstance(got, LeafMeta) or (got.dtype, got.requires_grad) != (
                    want.dtype,
                    want.requires_grad,
                ):
                    return None
            elif type(got) is not type(want) or (got is not want and got != want):
                return None
        return new

    def changes(self, new: Signature) -> str:
        """The tensor leaves whose shape differs in ``new``: "['h'] (2, 4, 6) -> (2, 5, 6)"."""
        moved = [
            f"{path or 'the tensor'} {a.shape} -> {b.shape}"
            for (path, a), (_, b) in zip(self.metas(False), new.metas(False), strict=True)
            if a.shape != b.shape
        ]
        return ", ".join(moved) or "no shape"

    def build(self, tensors: list[Tensor]) -> Any:
        """The received tree: ``tensors`` in the tensor leaves (flagged as requiring grad
        where agreed), the agreed constants elsewhere."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            if leaves[i].requires_grad:
                t.requires_grad_()
            leaves[i] = t
        return unflatten(leaves, self.spec)


def _leaf_mismatch(path: str, got: Tensor, want: LeafMeta, grad: bool = False) -> str:
    if tuple(got.shape) != want.shape or got.dtype != want.dtype:
        at = f"{path} " if path else ""
        return f"{at}{tuple(got.shape)} {_dtype(got.dtype)} instead of {want.shape} {_dtype(want.dtype)}"
    if not grad and got.requires_grad != want.requires_grad:
        at = f"{path} " if path else "the tensor "
        state = "requires" if got.requires_grad else "does not require"
        return (
            f"{at}{state} grad but the handshake agreed otherwise (whether a leaf carries a "
            "gradient must be the same for every micro-batch)"
        )
    return ""
