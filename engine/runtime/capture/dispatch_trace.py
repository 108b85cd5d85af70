"""Every aten call a block of code makes, recorded through a ``TorchDispatchMode``.

Why: what a CUDA graph captures is exactly the sequence of aten calls a program makes below
autograd -- kernel launches with their arguments baked in -- and what a launch-bound step costs
is roughly how many of them launch a kernel. Both can be observed on a CPU: a dispatch mode
sees every aten call (forward, autograd's backward, optimizer ops), with its tensors' storage
addresses, whether it writes them, its non-tensor arguments and whether it reads a value back
on the host. :mod:`engine.runtime.capture.audit` compares two recordings of a window for the
capture preconditions; tests count the calls per action for the launch budget.

What a dispatch mode cannot see: work outside the dispatcher, i.e. the C++ CPU SGD loop
(``engine._C.sgd_step_cpu``, set ``PE_CPU_LOOP=0`` to route those steps through torch ops,
which read and write the same tensors) and Triton kernels; Python-side host reads that do not
call aten (``tensor.tolist()`` on a CPU tensor) are invisible too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Access", "KeepingRecorder", "OpRecord", "Recorder", "host_sync_reason", "is_view",
           "op_name", "returns_fresh", "schema"]

_aten = torch.ops.aten
#: ops that return a host value or a shape that depends on the data: on a GPU each one waits
#: for the device (``.item()``, ``bool(t)``, ``nonzero``, ``masked_select``, ``torch.equal``)
_SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_SCALAR_RETURNS = {"bool", "int", "float", "number", "Scalar", "SymInt", "SymBool", "SymFloat"}
#: metadata queries that answer from the tensor's sizes, never from its data
_METADATA = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "dim", "size", "stride",
             "numel", "is_same_size", "is_floating_point", "is_complex", "_nnz"}
#: calls that move no data and launch nothing
_NO_KERNEL = {"detach", "alias", "lift_fresh", "empty", "empty_strided", "empty_like",
              "_unsafe_view", "set_", "resize_",
              "_record_function_enter_new", "_record_function_exit"}  # profiler labels


def schema(func: Any) -> Any:
    """An aten overload's schema (torch keeps it as ``func._schema``; this is the one read)."""
    return func._schema


def op_name(func: Any) -> str:
    """``func``'s name without its namespace (``aten::add_.Tensor`` -> ``add_``)."""
    return str(schema(func).name.split("::")[-1])


def returns_fresh(func: Any) -> bool:
    """Whether ``func``'s outputs are new tensors (none aliases an argument)."""
    return not any(r.alias_info is not None for r in schema(func).returns)


def host_sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> str | None:
    """Why ``func`` waits for the device on a GPU (None: it does not)."""
    base = op_name(func)
    if base in _METADATA:
        return None
    if any(tag in func.tags for tag in _SYNC_TAGS):
        return "reads a value back or has a data-dependent output shape"
    rets = [str(r.type) for r in schema(func).returns]
    if rets and all(r in _SCALAR_RETURNS for r in rets):
        return f"returns a host {rets[0]}"
    if base in ("_to_copy", "copy_", "to"):
        ins = {t.device.type for t in _tensors((args, kwargs))}
        outs = {t.device.type for t in _tensors(out)}
        if "cpu" in ins | outs and len(ins | outs) > 1:
            return "copies between host and device"
    return None


def is_view(func: Any) -> bool:
    """True when ``func`` launches no kernel: a view, a metadata change or an allocation."""
    base = op_name(func)
    if base in _NO_KERNEL or base in _METADATA:
        return True
    rets = schema(func).returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


_TORCH_DIR = os.path.dirname(torch.__file__)
_TESTING_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller() -> str:
    """Who made the current aten call: the innermost frame outside torch and this package
    (host syncs are rare, so walking the stack for each costs nothing that matters)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _TESTING_DIR)):
            parts = path.replace(os.sep, "/").rsplit("/engine/", 1)
            short = "engine/" + parts[1] if len(parts) == 2 else os.path.basename(path)
            return f"{short}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


@dataclasses.dataclass(frozen=True)
class Access:
    """One tensor an op read (``write`` False) or wrote.

    ``source`` is the index of the op in the same recording that allocated the tensor's
    storage (a value made inside the window), or None for a tensor from outside the window
    (weights, optimizer state, the input batch, activations carried from an earlier window):
    under capture an inside value lives in the graph's pool, an outside one must sit at the
    same address on every replay."""

    role: str  # "in:<argument>" or "out:<index>"
    write: bool
    ptr: int
    storage: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: int | None


@dataclasses.dataclass(frozen=True)
class OpRecord:
    index: int
    name: str
    #: the non-tensor arguments (scalars such as a learning rate are baked into a captured launch)
    constants: str
    accesses: tuple[Access, ...]
    sync: str | None
    view: bool
    #: the label current when the op ran (see :meth:`Recorder.label`)
    label: Any = None
    #: for a host sync: the innermost caller outside torch and engine.testing ("file:function")
    where: str | None = None


class Recorder(TorchDispatchMode):
    """Records every aten call made while active (``with Recorder() as rec: ...``).

    ``rec.ops`` lists :class:`OpRecord` in call order; ``rec.allocated`` maps a storage
    address to the op that allocated it in this recording. ``rec.label`` is attached to every
    op recorded while it is set: a test sets it from the executor's action hook to attribute
    ops to actions. ``on_op(record)``, when given, is called for every op (e.g. to raise on a
    host sync at the point it happens)."""

    def __init__(self, on_op: Callable[[OpRecord], None] | None = None) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []
        self.allocated: dict[int, int] = {}
        self.label: Any = None
        self.on_op = on_op

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _access(self, role: str, write: bool, t: Tensor, fresh: bool) -> Access | None:
        if t.numel() == 0 or t.device.type == "meta":
            return None
        storage = t.untyped_storage().data_ptr()
        source = self.allocated.get(storage)
        if fresh:
            source = len(self.ops)
        return Access(role, write, t.data_ptr(), storage, tuple(t.shape), t.dtype, source)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        sig = schema(func)
        view = is_view(func)
        accesses: list[Access] = []
        constants: list[str] = []
        for pos, arg in enumerate(sig.arguments):
            if pos < len(args):
                value = args[pos]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                continue
            tensors = _tensors(value)
            if isinstance(value, torch.UntypedStorage):
                # by address, not by its repr (which lists its contents): Triton's CPU
                # interpreter re-points tensors at their storages (set_) around each launch
                constants.append(f"{arg.name}=storage@{value.data_ptr()}")
                continue
            if not tensors:
                constants.append(f"{arg.name}={value!r}")
                continue
            if view:  # moves no data: the ops that read the view are checked instead
                continue
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tensors:
                a = self._access(f"in:{arg.name}", write, t, False)
                if a is not None:
                    accesses.append(a)
        # outputs that alias an input (views, in-place results) were recorded as inputs
        if not any(r.alias_info is not None for r in sig.returns):
            for k, t in enumerate(_tensors(out)):
                a = self._access(f"out:{k}", True, t, True)
                if a is not None:
                    accesses.append(a)
                    self.allocated[a.storage] = len(self.ops)
        sync = host_sync_reason(func, args, kwargs, out)
        rec = OpRecord(
            len(self.ops), str(func), ", ".join(constants), tuple(accesses),
            sync, view, self.label, _caller() if sync is not None else None,
        )
        self.ops.append(rec)
        if self.on_op is not None:
            self.on_op(rec)


class KeepingRecorder(Recorder):
    """A :class:`Recorder` that also keeps the fresh outputs of the calls it records (strong
    references, in ``kept``; :meth:`tensor` reads one): a captured asynchronous window's ring
    slots are such tensors (engine.runtime.capture.asynchronous). Keeping them changes what autograd
    does inside the window (it accumulates a gradient in place only into a buffer nobody else
    holds: ``add_`` becomes ``add``), so windows are only comparable when recorded under the
    same keeping."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[tuple[int, int], Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = len(self.ops)
        if returns_fresh(func):
            for k, t in enumerate(_tensors(out)):
                self.kept[(n, k)] = t
        self._record(func, args, kwargs, out)
        return out

    def tensor(self, key: tuple[int, int]) -> Tensor | None:
        """Output ``key`` of the recording (None: not a fresh output)."""
        return self.kept.get(key)
