"""In-flight state of an unflushed asynchronous pipeline: saved with its state dict, rebuilt
on load, so that save at step k + load + continue equals the never-interrupted run bit for bit.

Why a module of its own (:mod:`~engine.runtime.state.state` holds the flushed part): between two
steps an asynchronous pipeline holds micro-batches in flight -- per stage the stashed
forwards (input, pinned weight version, loss scale), the kept weight versions, the gradient
accumulated for the current update group and its bookkeeping; in the executor the fed inputs
not yet read, the activations and gradients in the mailboxes between stages and the segment
counters. All of it is tensors plus JSON-able metadata, so it flows through ``engine.save``
and any per-rank writer of state dicts.

Why re-run the forwards rather than save activations: an autograd graph cannot be
serialized, and the backward needs one. A forward in flight is re-run (CPU: bitwise the same
graph and values) from its saved stage input

* on the weight version it pinned (pipedream's stashing, 2bw, SpecTrain's reuse), restored
  from the saved kept buffers;
* on any weights when its stage recomputes (``checkpoint="always"``): the forward keeps only
  its input and the backward re-runs it on the backward's weights;
* on the live weights (or the saved transient) when no update has overwritten them since.

Otherwise -- pb and its mitigations without recomputation, once an update overwrote the live
weights a forward read (pb keeps no old versions: its point) -- the forward cannot be re-run,
and ``capture`` raises naming the stage and micro-batch. So does a stage with an active
``nn.Dropout`` (the re-run would draw other masks).

Under gloo/NCCL each rank saves its own stage, plus the messages on the wire
(``RankExecutor.wire_state``): every rank must call ``state_dict()`` at the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.errors import CheckpointError, NotFlushedError
from engine.runtime.stage import trees
from engine.runtime.exec.executor import _Input
from engine.runtime.stage.stage import DROPPED, Stage
from engine.runtime.stage.stash import StashEntry

if TYPE_CHECKING:
    from engine.runtime.parts import PipelineParts

__all__ = ["capture", "check", "restore"]


def _refuse(parts: PipelineParts, why: str) -> NotFlushedError:
    return NotFlushedError(
        f"state_dict() of an unflushed {parts.spec.describe()} pipeline: {why}; call "
        "pipe.flush() first"
    )


def _mail(v: Any) -> dict[str, Any]:
    """A mailbox value (a tensor or a tensor tree, DROPPED, or None) as saved state."""
    if v is DROPPED:
        return {"kind": "dropped"}
    if v is None:
        return {"kind": "none"}
    value, flags = trees.detached_copy(v)
    return {"kind": "value", "value": value, "grad": flags}


def _unmail(d: dict[str, Any]) -> Any:
    if d["kind"] != "value":
        return DROPPED if d["kind"] == "dropped" else None
    return trees.with_grad_flags(d["value"], d["grad"])  # an output's flags: a gradient comes back


def _rebuildable(parts: PipelineParts, st: Stage, e: StashEntry) -> None:
    """A forward can be re-run when it pinned its weights, when its stage recomputes (the
    backward re-runs it on the backward's weights, whatever the forward read), or when no
    update has overwritten the weights it read since."""
    if e.dropped or e.pin is not None or st.recompute or e.t_f == st.updates:
        return
    raise _refuse(
        parts,
        f"stage {st.index}'s forward of micro-batch {parts.executor.n_base + e.i} read weight "
        f"version {e.t_f}, which updates have overwritten since (policy {st.policy.name!r} "
        "keeps no old versions to re-run it on); build the pipeline with "
        "checkpoint='always' to save it unflushed",
    )


def _stage_state(parts: PipelineParts, st: Stage) -> dict[str, Any]:
    for name, m in st.module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise _refuse(parts, f"stage {st.index}'s {name or 'module'} is an active dropout")
    store = st.store
    skip = st.bridge.skip if st.bridge is not None else None
    stash = []
    for e in sorted(st.stash.entries(), key=lambda e: e.i):
        _rebuildable(parts, st, e)
        x, flags = (None, []) if e.dropped else trees.detached_copy(e.x)
        stash.append({
            "i": e.i,
            "x": x,
            "x_grad": flags,
            "target": _copy(e.target),
            "pin": list(e.pin) if e.pin is not None else None,
            "t_f": e.t_f,
            "scale": e.scale,
            "dropped": e.dropped,
            "flag": e.flag.clone() if e.flag is not None else None,  # on_nonfinite="skip_update"
        })
    return {
        "index": st.index,
        "policy": st.policy.name,
        "forwards": st.forwards,
        "segment_updates": st.segment_updates,
        "pending": st.pending,
        "pending_weight": st.pending_weight,
        "pending_mbs": list(st.pending_mbs),
        "t_f": [[n, t] for n, t in st.versions_read.items()],
        "grads": store.grad_state(),  # zeros where an update left them stale
        **store.kept_state(),  # used, slots, transient, live_pins, held
        "stash": stash,
        "found_inf": skip.state() if skip is not None else None,
    }


def capture(parts: PipelineParts) -> dict[str, Any] | None:
    """The in-flight state of ``parts`` (None when flushed); changes nothing. Raises
    NotFlushedError naming why when it cannot be rebuilt on load (module docstring)."""
    ex = parts.executor
    if ex.in_flight() == 0 and not (parts.config.distributed and ex.active):
        return None  # (a rank with nothing in flight may still have messages on the wire)
    if ex.tail is not None:
        raise _refuse(parts, "a step was interrupted and the rest of its program is pending")
    # messages between ranks first: a gradient received now brings its "skip_update" flag
    # into the stash entry that the stage's state holds
    wire = ex.wire_state() if parts.config.distributed else None
    stages = [_stage_state(parts, st) for st in parts.stages]
    return {
        "wire": wire,
        "n_base": ex.n_base,
        "j": ex.j,
        "inputs": [
            {"i": i, "x": _copy(inp.x), "target": _copy(inp.target), "samples": inp.samples,
             "readers": inp.readers}
            for i, inp in sorted(ex.inputs.items())
        ],
        "acts": [
            {"s": s, "i": i,
             **_mail(v[0])}
            for (s, i), v in sorted(ex.acts.items())
        ],
        "grads": [
            {"s": s, "i": i, **_mail(v[0])}
            for (s, i), v in sorted(ex.grads.items())
        ],
        "stages": stages,
    }


def _copy(tree: Any) -> Any:
    """A copy of the caller's tensors: the state must not change if the caller's do."""
    return trees.map_tensors(lambda t: t.detach().clone(), tree) if tree is not None else None


def _fail(msg: str) -> CheckpointError:
    return CheckpointError(f"in-flight state: {msg} -- nothing was loaded")


def _same(theirs: list[Any], ours: list[Tensor], what: str) -> None:
    if len(theirs) != len(ours) or any(
        not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype
        for a, b in zip(theirs, ours, strict=False)
    ):
        raise _fail(f"{what} do not match the pipeline's buffers")


def check(parts: PipelineParts, state: Any) -> None:
    """Validate in-flight ``state`` against ``parts`` before anything changes."""
    if not isinstance(state, dict) or not isinstance(state.get("stages"), list):
        raise _fail("not an in-flight state dict")
    if (state.get("wire") is not None) != parts.config.distributed:
        raise _fail("saved by a pipeline of another transport (messages between ranks)")
    if state.get("wire") is not None and not _shapes_ok(state["wire"].get("shapes", {})):
        raise _fail("the shapes of the activations in flight are malformed")
    stages = state["stages"]
    if [sd.get("index") for sd in stages] != [st.index for st in parts.stages]:
        raise _fail(
            f"saved for stages {[sd.get('index') for sd in stages]}, this pipeline holds "
            f"{[st.index for st in parts.stages]}"
        )
    for st, sd in zip(parts.stages, stages, strict=True):
        where = f"stage {st.index}"
        if sd.get("policy") != st.policy.name:
            raise _fail(f"{where}: weight policy {sd.get('policy')!r} saved, {st.policy.name!r} here")
        _same(sd.get("grads", []), st.store.grad_flats(), f"{where}: pending gradients")
        skip = st.bridge.skip if st.bridge is not None else None
        if sd.get("found_inf") is not None and skip is None:
            raise _fail(
                f"{where}: saved with on_nonfinite='skip_update' (its pending update group "
                "carries non-finite flags), this pipeline has another on_nonfinite"
            )
        for v in sd.get("slots", []):
            _same(v.get("flats", []), st.store.live_flats(), f"{where}: weight buffer {v.get('slot')}")
        for e in sd.get("stash", []):
            if not e["dropped"] and not trees.tensors(e.get("x")):
                raise _fail(f"{where}: micro-batch {e.get('i')} has no saved input")
            if not e["dropped"] and (why := trees.grad_flags_mismatch(e["x"], e.get("x_grad"))):
                raise _fail(f"{where}: micro-batch {e.get('i')}'s input has {why}")
    for box in ("acts", "grads"):
        for d in state.get(box, []):
            if d.get("kind") == "value" and (why := trees.grad_flags_mismatch(d.get("value"), d.get("grad"))):
                raise _fail(f"the {box[:-1]} for stage {d.get('s')} of micro-batch {d.get('i')} has {why}")


def _shapes_ok(shapes: Any) -> bool:
    """{"send"|"recv": [[micro-batch, [leaf shape, ...]], ...]} with ints >= 0 (wire_shapes)."""
    def dims(shape: Any) -> bool:
        return isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)

    return isinstance(shapes, dict) and all(
        isinstance(rows, list) and all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[0], int)
            and isinstance(r[1], list) and all(dims(s) for s in r[1])
            for r in rows
        )
        for rows in shapes.values()
    )


def _restore_store(st: Stage, sd: dict[str, Any]) -> dict[int, int]:
    """Pending gradients and kept buffers (into fresh arena slots); returns saved slot id ->
    new slot id."""
    st.store.load_grads(sd["grads"])
    return st.store.load_kept_state(sd)


def restore(parts: PipelineParts, state: dict[str, Any]) -> None:
    """Rebuild the in-flight state (``check``-ed) into ``parts``, whose flushed state was just
    loaded: kept versions and pending gradients, then every stashed forward re-run on its
    pinned version, then the executor's mailboxes and counters. Module buffers a forward
    updates (BatchNorm statistics) are put back afterwards; the caller restores the RNG."""
    ex = parts.executor
    streams = ex.streams
    for st, sd in zip(parts.stages, state["stages"], strict=True):
        moved = _restore_store(st, sd)
        # with stage streams the re-run forwards run on the stage's stream, as they did
        # (their saved tensors are freed by backwards there), after what the caller wrote
        streams.wait_caller()
        streams.from_caller([(e.get("x"), e.get("target")) for e in sd["stash"]], [st.index])
        with streams.on(st.index):
            _rebuild(st, sd, moved, int(state["n_base"]))
    streams.join()  # the caller reads what the re-runs wrote (module buffers) after them
    ex.n_base = int(state["n_base"])
    ex.j = int(state["j"])
    ex.active = True
    ex.inputs = {
        d["i"]: _Input(d["x"], d["target"], d["samples"], d["readers"]) for d in state["inputs"]
    }
    ex.acts = {(d["s"], d["i"]): (_unmail(d), None) for d in state["acts"]}
    ex.grads = {(d["s"], d["i"]): (_unmail(d), None) for d in state["grads"]}
    if state.get("wire") is not None:
        ex.load_wire_state(state["wire"])
    if ex.streams.separate:  # made on the caller's stream, read on the stages' (held till safe)
        made = [x for x, _ in (*ex.acts.values(), *ex.grads.values())]
        made += [e.flag for st in parts.stages for e in st.stash.entries() if e.flag is not None]
        made += [(d["x"], d["target"]) for d in state["inputs"]]
        ex.streams.from_caller(made, [st.index for st in parts.stages])


def _rebuild(st: Stage, sd: dict[str, Any], moved: dict[int, int], n_base: int) -> None:
    """Re-run the stage's stashed forwards (``_rebuildable`` says which path) and restore
    its counters; module buffers a forward updates (BatchNorm statistics) are put back."""
    kept = [b.clone() for b in st.module.buffers()]
    with torch.enable_grad():
        for e in sd["stash"]:
            pin = None
            if e["pin"] is not None:
                kind, key = e["pin"]
                pin = (kind, moved[key] if kind == "t" else key)
            if e["dropped"]:
                st.stash.put(StashEntry(e["i"], None, None, pin, e["t_f"], e["scale"], dropped=True))
                continue
            xin = trees.with_grad_flags(e["x"], e["x_grad"])
            if pin is not None or st.recompute:
                st.rerun_forward(e["i"], xin, e["target"], pin, e["t_f"], e["scale"])
            else:  # nothing overwrote the weights it read: the forward itself, as it ran
                st.forward(e["i"], n_base + e["i"], xin, e["target"], e["scale"])
    st.settle()
    for b, k in zip(st.module.buffers(), kept, strict=True):
        b.data.copy_(k)  # through .data: the rebuilt graphs saved them at this version
    st.forwards = sd["forwards"]
    st.segment_updates = sd["segment_updates"]
    st.pending = sd["pending"]
    st.pending_weight = float(sd["pending_weight"])
    st.pending_mbs = list(sd["pending_mbs"])
    for e in sd["stash"]:
        entry = st.stash.get(e["i"])
        if entry is not None and e.get("flag") is not None:
            entry.flag = e["flag"]
    skip = st.bridge.skip if st.bridge is not None else None
    if skip is not None and sd.get("found_inf") is not None:
        skip.load(sd["found_inf"])  # into the persistent accumulator itself
    st.versions_read = {int(n): int(t) for n, t in sd["t_f"]}
