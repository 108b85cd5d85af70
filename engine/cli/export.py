"""``python -m engine export CKPT --out model.safetensors``: a checkpoint as the plain model.

Why a command: a run's checkpoint (``train``'s ``checkpoint.safetensors``, or the directory a
multi-process run wrote) holds the pipeline -- stages, optimizer state, counters -- but a model
is handed on as its ``state_dict``. This writes that ``state_dict`` (the model's own names,
every tied name; :func:`engine.export`) as a plain safetensors file, which
``model.load_state_dict(safetensors.torch.load_file(...))`` takes and from which
``engine.load(pipe, ...)`` starts a pipeline of any layout.
"""

from __future__ import annotations

import argparse

from engine.cli import CLIFailure

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint file, or the directory of a multi-process run")
    p.add_argument("--out", required=True, help="the model file to write (safetensors)")


def run(args: argparse.Namespace) -> int:
    import engine
    from engine.serialization import write_plain

    try:
        tensors = engine.export(args.checkpoint)
    except engine.CheckpointError as exc:
        raise CLIFailure(str(exc)) from None
    try:
        write_plain(tensors, args.out)
    except OSError as exc:
        raise CLIFailure(f"cannot write {args.out}: {exc.strerror or exc}") from None
    numel = sum(t.numel() for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({numel} values) of the model to {args.out}")
    return 0
