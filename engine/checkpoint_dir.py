"""Checkpoint directories: one file per rank of a gloo/NCCL pipeline, committed by a manifest.

``engine.save``/``engine.load`` (:mod:`engine.checkpoint`) send a multi-process pipeline
here; a single-process one uses the single-file format of :mod:`engine.serialization`.

Why a directory and not one file: under ``torchrun`` each process holds only its stage, so
each rank writes what its own ``state_dict()`` holds (weights, optimizer and scheduler state,
counters, RNG, and anything else a later engine adds to it) with
:func:`engine.serialization.write_state` -- safetensors + JSON, never pickle -- to
``rank<r>-<nonce>.safetensors``. Rank 0 writes ``manifest.json`` *last*, after every rank has
reported its file's SHA-256, with ``os.replace``: the manifest switch is the only commit
point, so a crash at any moment leaves either the previous manifest (and the files it names,
which are only deleted after the switch) or the new one. The manifest names every rank's
file and hash, the world layout (world, stages, replicas, schedule) and the format, and
carries a SHA-256 of its own body.

Each shard once (format 2): data-parallel replicas hold identical parameters and optimizer
state, so only replica 0 of each (stage, tp rank) writes them (``holds: all``); every other
replica writes what may differ between replicas (``holds: own``: buffers such as BatchNorm
statistics, scheduler, counters, RNG, micro-batches in flight) and names its writer
(``shared_from``), whose file it reads on load. Format 1 (every replica wrote everything)
still loads.

Why not ``torch.distributed.checkpoint``: its safetensors storage still writes its planner
metadata (``.metadata``) with pickle and reads it back with ``pickle.load``, so loading an
untrusted directory would unpickle. The per-rank files here reuse the single-file format, its
checksums and its validation; loading into another layout reads them by the model's names
(:mod:`engine.checkpoint_index`), each rank only the pieces its stages hold. The manifest
records each file's header checksum (``index_sha256``) so such a reader, which reads parts of
files, still checks that each file is the one the manifest committed.

Both directions are collective: every rank checks its own part first, the ranks exchange
a fixed-size status (hash + first error line, plain bytes), and either every rank proceeds
or every rank raises the same :class:`~engine.errors.CheckpointError` naming the first rank
that failed. On error nothing is loaded, and a failed save leaves the previous checkpoint
loadable.

The collectives checkpoints use go through two functions here, each taking the process
group: :func:`exchange_status` (the status above; the save's name suffix is one broadcast)
and :func:`gather_to_first` (``engine.export`` of a multi-process pipeline: every rank's
named tensors to the first rank). :func:`control_group` says which group they use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.errors import CheckpointError
from engine.serialization import file_sha256, read_state, write_state

if TYPE_CHECKING:
    from engine.runtime.pipeline import Pipeline

__all__ = ["save_dir", "load_dir", "read_manifest", "read_own", "exchange_status",
           "gather_to_first", "control_group", "raise_first", "layout_record", "MANIFEST",
           "DIR_FORMAT"]

DIR_FORMAT = "engine.checkpoint-dir/2"
#: format 1: every rank's file holds its whole state (each data-parallel replica wrote every
#: weight and optimizer shard again); still read
_READABLE = ("engine.checkpoint-dir/1", DIR_FORMAT)
#: a file that holds only the part of a rank's state that is its own (see _own_part)
_OWN_ONLY = "replica-own"
MANIFEST = "manifest.json"
_RANK_FILE = re.compile(r"rank\d+-[0-9a-f]{16}\.safetensors(\.tmp-\d+)?$")
#: bytes of a rank's status: its digest (the file's hex SHA-256 and ":" and its header
#: checksum), then its error (utf-8)
_HASH, _TEXT = 136, 960


def control_group(pipe: Pipeline) -> Any:
    """The process group checkpoint control messages and exports use: the job's gloo control
    group (every rank; under NCCL a gloo group beside the NCCL ones, so a host exchange never
    queues behind a pipeline's device traffic: engine/runtime/ranks/transport/control.py)."""
    from engine.runtime.ranks.transport.control import world_group

    return world_group(pipe.parts.config.timeout)


def _device(pipe: Pipeline) -> torch.device:
    """Where the control group's tensors live: host memory (gloo)."""
    return torch.device("cpu")


def exchange_status(group: Any, device: torch.device, digest: str, error: str) -> list[tuple[str, str]]:
    """Collective over ``group``: every rank's (sha256, error) -- plain bytes over one
    all_gather, no pickle."""
    msg = torch.zeros(_HASH + _TEXT, dtype=torch.uint8)
    msg[: len(digest)] = torch.tensor(list(digest.encode()), dtype=torch.uint8)
    text = error.encode()[:_TEXT]
    if text:
        msg[_HASH : _HASH + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    parts = [torch.empty_like(msg, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, msg.to(device), group=group)
    out = []
    for p in parts:
        b = p.numpy().tobytes()
        out.append((b[:_HASH].rstrip(b"\0").decode(), b[_HASH:].rstrip(b"\0").decode(errors="replace")))
    return out


def _exchange(pipe: Pipeline, digest: str, error: str) -> list[tuple[str, str]]:
    """Every rank's (sha256, error) over the pipeline's control group."""
    return exchange_status(control_group(pipe), _device(pipe), digest, error)


def gather_to_first(group: Any, device: torch.device, payload: dict[str, Any],
                    tensors: list[Tensor]) -> list[tuple[dict[str, Any], list[Tensor]]]:
    """Collective over ``group``: every rank's JSON ``payload`` and ``tensors`` arrive at the
    group's first rank (returned there, in rank order, its own first; ``[]`` elsewhere).
    No pickle: one all_gather of the message sizes, then each rank sends its JSON (shapes and
    dtypes included) and its tensors to the first rank point to point."""
    body = json.dumps({"payload": payload,
                       "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]})
    data = torch.frombuffer(bytearray(body.encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    if me != 0:
        dist.send(data.to(device), first, group=group)
        for t in tensors:
            if t.numel():
                dist.send(t.detach().contiguous().to(device), first, group=group)
        return []
    out = [(payload, [t.detach().cpu() for t in tensors])]
    for r in range(1, world):
        src = dist.get_global_rank(group, r) if group is not None else r
        buf = torch.empty(int(sizes[r].item()), dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group)
        got = json.loads(bytes(buf.cpu().tolist()).decode())
        received = []
        for shape, dtype in got["tensors"]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            if t.numel():
                dist.recv(t, src, group=group)
            received.append(t.cpu())
        out.append((got["payload"], received))
    return out


def raise_first(statuses: list[tuple[str, str]], what: str) -> None:
    bad = [(r, err) for r, (_, err) in enumerate(statuses) if err]
    if bad:
        r, err = bad[0]
        more = f" (ranks {[b[0] for b in bad]} failed)" if len(bad) > 1 else ""
        raise CheckpointError(f"{what} failed on rank {r}{more}: {err}")


def _layout(pipe: Pipeline) -> dict[str, Any]:
    lay = pipe.layout
    out = {"world": lay.world, "stages": lay.stages, "replicas": lay.replicas, "schedule": pipe.spec.name}
    if getattr(lay, "tp", 1) > 1:  # tensor parallelism: each file holds one tp shard (runtime/ranks/mesh.py)
        out["tensor_parallel"] = lay.tp
    return out


layout_record = _layout  # what the manifest records as "layout"


def _writer_of(pipe: Pipeline) -> Callable[[int], int]:
    """Global rank -> the rank whose file holds its replica-shared state: replica 0 at the same
    (stage, tp rank). Data-parallel replicas hold identical weights and optimizer state (the
    gradient all-reduce precedes every update), so one replica writes them."""
    lay = pipe.layout
    S = lay.stages
    place = getattr(lay, "place_of", lambda r: (r % S, r // S, 0))
    first = {}
    for r in range(lay.world):
        st, rep, tp = place(r)
        if rep == 0:
            first[(st, tp)] = r
    return lambda r: first[(place(r)[0], place(r)[2])]


def _shared_keys(module: torch.nn.Module, sd: dict[str, Any]) -> list[str]:
    """The module entries every replica holds alike: its parameters. Everything else (buffers
    such as BatchNorm statistics, which come from each replica's own micro-batches; a module's
    extra state) stays per replica."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return [k for k in sd if k in params]


def _own_part(pipe: Pipeline, state: dict[str, Any]) -> dict[str, Any]:
    """What a data-parallel replica other than 0 writes: its state without the module's
    parameters, the optimizer state and the runtime optimizer state (``extra``), which replica
    0's file holds. Its buffers, LR scheduler, counters, RNG and micro-batches in flight
    (activations and skip flags of its own data) stay: they may differ between replicas."""
    stages = []
    for st, sd in zip(pipe.parts.stages, state["stages"], strict=True):
        drop = set(_shared_keys(st.module, sd["module"]))
        own = {k: v for k, v in sd.items() if k not in ("optimizer", "extra")}
        own["module"] = {k: v for k, v in sd["module"].items() if k not in drop}
        own[_OWN_ONLY] = True
        stages.append(own)
    return {**state, "stages": stages}


def _merge(own: dict[str, Any], shared: dict[str, Any], writer_file: str) -> dict[str, Any]:
    """A replica's whole state: its own file's part plus the writer's parameters and optimizer."""
    stages = []
    if len(own.get("stages", [])) != len(shared.get("stages", [])):
        raise CheckpointError(f"{writer_file!r} holds {len(shared.get('stages', []))} stages, "
                              f"the replica's own file {len(own.get('stages', []))}")
    for mine, theirs in zip(own["stages"], shared["stages"], strict=True):
        if mine.get("index") != theirs.get("index"):
            raise CheckpointError(f"{writer_file!r} holds stage {theirs.get('index')} where the "
                                  f"replica's own file holds stage {mine.get('index')}")
        sd = {k: v for k, v in mine.items() if k != _OWN_ONLY}
        sd["module"] = {**theirs["module"], **mine["module"]}  # the replica's own buffers win
        sd["optimizer"] = theirs.get("optimizer")
        sd["extra"] = theirs.get("extra", {})
        stages.append(sd)
    return {**own, "stages": stages}


def _body_sha256(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_dir(pipe: Pipeline, path: str | os.PathLike[str]) -> None:
    """Collective: every rank writes its state into directory ``path``; rank 0 commits."""
    path = os.fspath(path)
    lay = pipe.layout
    # one fresh name suffix for the whole checkpoint, never from torch's RNG (part of the state)
    nonce = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=_device(pipe))
    group = control_group(pipe)
    dist.broadcast(nonce, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    name = f"rank{lay.rank:05d}-{int(nonce.item()):016x}.safetensors"
    target = os.path.join(path, name)
    digest, error = "", ""
    try:
        os.makedirs(path, exist_ok=True)
        state = pipe.state_dict()
        index = write_state(state if lay.replica == 0 else _own_part(pipe, state), target)
        digest = f"{file_sha256(target)}:{index}"  # (the manifest records both)
    except Exception as exc:  # reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    statuses = _exchange(pipe, digest, error)
    try:
        raise_first(statuses, f"saving checkpoint {path!r}")
    except CheckpointError:
        if os.path.exists(target):
            os.remove(target)  # a fresh name: the previous manifest never named it
        raise
    error = ""
    if lay.rank == 0:
        try:
            _commit(pipe, path, nonce_name=name.split("-", 1)[1], statuses=statuses)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise_first(_exchange(pipe, "", error), f"committing checkpoint {path!r}")


def _commit(pipe: Pipeline, path: str, nonce_name: str, statuses: list[tuple[str, str]]) -> None:
    """Rank 0: write the manifest atomically, then delete rank files it does not name."""
    S = pipe.layout.stages
    place = getattr(pipe.layout, "place_of", lambda r: (r % S, r // S, 0))  # (a mesh: runtime/ranks/mesh.py)
    writer = _writer_of(pipe)
    ranks = [
        {"rank": r, "stage": place(r)[0], "replica": place(r)[1], "file": f"rank{r:05d}-{nonce_name}",
         "sha256": h.split(":")[0], **({"tp_rank": place(r)[2]} if getattr(pipe.layout, "tp", 1) > 1 else {}),
         "holds": "all" if writer(r) == r else "own", "shared_from": writer(r),
         # the header checksum: a reader of parts of the file checks that it is this one
         **({"index_sha256": h.split(":")[1]} if ":" in h else {})}
        for r, (h, _) in enumerate(statuses)
    ]
    body = {"format": DIR_FORMAT, "layout": _layout(pipe), "steps": pipe.steps, "ranks": ranks,
            "holds": {"all": "the rank's whole state", "own": (
                "the rank's own part: module buffers, LR scheduler, counters, RNG, micro-batches "
                "in flight; its parameters, optimizer state and runtime optimizer state are in "
                "the file of rank 'shared_from' (replica 0 of the same stage and tp rank)")}}
    manifest = os.path.join(path, MANIFEST)
    tmp = f"{manifest}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**body, "sha256": _body_sha256(body)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, manifest)
    keep = {e["file"] for e in ranks}
    for old in os.listdir(path):
        if _RANK_FILE.match(old) and old not in keep:
            os.remove(os.path.join(path, old))


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``, checked; CheckpointError otherwise."""
    manifest = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(manifest) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{manifest!r} does not exist: no complete checkpoint in {os.fspath(path)!r} "
            "(a save that crashed before its manifest leaves none)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {manifest!r}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") not in _READABLE:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(
            f"{manifest!r} has format {got!r}; this engine reads "
            + " and ".join(repr(f) for f in _READABLE)
        )
    body = {k: v for k, v in data.items() if k != "sha256"}
    if _body_sha256(body) != data.get("sha256"):
        raise CheckpointError(f"{manifest!r} is corrupted: it does not match its SHA-256 checksum")
    return data


def read_own(pipe: Pipeline, path: str) -> dict[str, Any]:
    """This rank's state from directory ``path`` (manifest, layout and hash checked)."""
    man = read_manifest(path)
    mine = _layout(pipe)
    if man["layout"] != mine:
        diff = "; ".join(
            f"{k}: checkpoint {man['layout'].get(k, 1)!r} vs this job {mine.get(k, 1)!r}"
            for k in [*mine, *(k for k in man["layout"] if k not in mine)]
            if man["layout"].get(k, 1) != mine.get(k, 1)
        )
        raise CheckpointError(
            f"checkpoint {path!r} was written by a different world layout ({diff}); load it "
            "with the same number of processes, stages, data_parallel replicas and tensor-"
            "parallel degree (tensor_parallel: each file holds one shard of that degree; "
            "resharding to another degree is not supported)"
        )
    r = pipe.layout.rank
    entry = man["ranks"][r]
    S = pipe.layout.stages
    here = getattr(pipe.layout, "place_of", lambda q: (q % S, q // S, 0))(r)
    there = (entry.get("stage"), entry.get("replica"), entry.get("tp_rank", 0))
    if there != here:
        raise CheckpointError(
            f"rank {r} held (stage, replica, tp rank) {there} when checkpoint {path!r} was "
            f"written, {here} in this job: build the mesh with the same dimension order"
        )
    pipe.require_flushed("engine.load")
    state = _checked_read(path, entry, f"rank {r}'s file")
    if man["format"] == DIR_FORMAT and entry.get("holds") == "own":
        w = entry.get("shared_from")
        if not isinstance(w, int) or not 0 <= w < len(man["ranks"]) or man["ranks"][w].get("holds") != "all":
            raise CheckpointError(f"{os.path.join(path, MANIFEST)!r}: rank {r}'s shared_from "
                                  f"{w!r} names no rank that holds a whole state")
        went = man["ranks"][w]
        what = f"rank {w}'s file (it holds rank {r}'s parameters and optimizer state)"
        state = _merge(state, _checked_read(path, went, what), went["file"])
    return state


def _checked_read(path: str, entry: dict[str, Any], what: str) -> dict[str, Any]:
    file = os.path.join(path, entry["file"])
    if not os.path.exists(file):
        raise CheckpointError(f"{what} {file!r}, named by the manifest, is missing")
    if file_sha256(file) != entry["sha256"]:
        raise CheckpointError(f"{what} {file!r} is corrupted: its SHA-256 differs from the manifest's")
    return read_state(file)


def load_dir(pipe: Pipeline, path: str | os.PathLike[str], override_hyperparameters: bool = False) -> None:
    """Collective: every rank loads its file from directory ``path``, or none does."""
    from engine.runtime.state.state import check_state, load_pipeline_state_dict

    path = os.fspath(path)
    state: dict[str, Any] | None = None
    error = ""
    try:
        state = read_own(pipe, path)
        check_state(pipe.parts, state, override_hyperparameters)
    except Exception as exc:  # reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    raise_first(_exchange(pipe, "", error), f"loading checkpoint {path!r}")
    assert state is not None
    load_pipeline_state_dict(pipe.parts, state, override_hyperparameters)


_read_own = read_own  # (the name tests used)
