"""Which process runs which (replica, stage), and the process groups that connect them.

The 2-D layout of ``world = R * S`` processes (R data-parallel replicas of an S-stage
pipeline): global rank ``r`` runs stage ``r % S`` of replica ``r // S``. So with torchrun's
``--nproc-per-node`` filled node by node, consecutive ranks (usually the same node) form one
pipeline and neighbouring stages talk over the fastest links, while the gradient all-reduce
of a stage runs across replicas once per update.

Groups: one pipeline group per replica (its S ranks) and one data-parallel group per stage
(its R ranks; the gradient all-reduce). Under gloo the pipeline group carries the
point-to-point traffic and the host messages (the engine creates it, also when there is one
replica: not the default group, which the user may also use; transport/groups.py). Under
NCCL (:mod:`~engine.runtime.ranks.transport.nccl`, which says why):

* the pipeline group carries device collectives only (clipping norms, loss-scale flags);
* each boundary between stages b and b+1 gets two groups of its two ranks, one per channel
  direction (:class:`ChannelGroups`): activations b -> b+1, gradients b+1 -> b;
* a gloo group of the pipeline's ranks is its control plane (control.py): handshake, loss,
  verdicts, shape notices.

``torch.distributed.new_group`` is collective over the whole world, so every rank creates
every group in the same order here.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from engine.runtime.ranks.transport.groups import new_group

__all__ = [
    "ChannelGroups", "Layout", "make_layout", "init_distributed", "pipeline_groups",
    "nccl_twin", "transport_device", "bind_device",
]

#: ``(channel, boundary) -> group``: under NCCL the two-rank group of each direction of each
#: boundary between stages ``boundary`` and ``boundary + 1`` ("act": activations down,
#: "grad": gradients up) that this rank is on
ChannelGroups = dict[tuple[str, int], Any]


@dataclasses.dataclass(frozen=True)
class Layout:
    """This process's place in the R x S grid and its groups."""

    rank: int
    world: int
    stages: int
    replicas: int
    stage: int
    replica: int
    pipeline_ranks: tuple[int, ...]  # global rank of every stage of this replica
    pipeline_group: Any
    dp_ranks: tuple[int, ...]  # global rank of this stage in every replica
    dp_group: Any  # None when replicas == 1
    #: position in ``pipeline_ranks`` of the rank that holds the last stage (the loss): the
    #: last one, except under a placement such as the V (engine/runtime/exec/placement.py)
    last_index: int = -1
    #: the gloo group of this pipeline's host messages (control.py): under gloo the pipeline
    #: group itself
    control_group: Any = None
    #: NCCL: the channel groups of this rank's boundaries (:data:`ChannelGroups`)
    channel_groups: Any = None

    @property
    def last_rank(self) -> int:
        """Global rank of this replica's last stage (it computes the loss)."""
        return self.pipeline_ranks[self.last_index]

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (computes the loss and sends it)."""
        return self.stage == self.last_index % self.stages


def nccl_twin() -> bool:
    """Whether ``transport="nccl"`` runs over the NCCL-semantics twin on the CPU
    (``ENGINE_NCCL_TWIN=1``, or a default group the user initialised with it):
    engine.testing.nccl_twin says what it enforces."""
    if os.environ.get("ENGINE_NCCL_TWIN", "").strip() == "1":
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl_twin"


def _backend_name(backend: str) -> str:
    """The torch.distributed backend that carries ``transport=backend``."""
    if backend == "nccl" and nccl_twin():
        import engine.testing.nccl_twin  # noqa: F401 -- registers the backend (the one import of testing)

        return "nccl_twin"
    return backend


def transport_device(backend: str) -> torch.device:
    """Where a rank's stage and its messages live: its GPU under NCCL (the CPU under the
    twin), the CPU under gloo."""
    if backend != "nccl" or nccl_twin():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def bind_device(explicit: Any = None) -> None:
    """Make this rank's GPU the current device before anything of NCCL's runs.

    ``explicit``: the device the user's default group is bound to (``init_process_group(...,
    device_id=...)``), if any. Otherwise torchrun's ``LOCAL_RANK`` decides, unless the
    program already chose another device than cuda:0 (a deliberate ``set_device``): left as
    it is. Without this, every rank of a group the user initialised without ``set_device``
    runs on cuda:0, which NCCL refuses ("duplicate GPU") or, worse, shares."""
    if nccl_twin():
        return
    if explicit is not None:
        torch.cuda.set_device(explicit)
        return
    local = os.environ.get("LOCAL_RANK")
    if local is None or torch.cuda.current_device() != 0:
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(
            "transport='nccl' needs a CUDA GPU per rank, and this process sees none; use "
            "transport='gloo' on CPU (or ENGINE_NCCL_TWIN=1 to run the NCCL code path on the "
            "CPU twin for testing)"
        )
    torch.cuda.set_device(int(local) % count)


def init_distributed(backend: str, timeout: float) -> None:
    """Initialise the default process group from torchrun's environment, if not done yet.

    Why here: users of ``engine.Pipeline(..., transport="gloo")`` under torchrun should not
    have to remember the timeout (torch's default is 30 minutes, so a dead rank would hang
    its peers that long). An already initialised group is used as it is (under NCCL the
    rank's GPU is still chosen: :func:`bind_device`).
    """
    # imported before the group exists, so that its functions' default ``group=group.WORLD``
    # binds None, not the live group (which would then outlive destroy_process_group at exit,
    # gloo threads and all: teardown.release_captured_world)
    import torch.distributed.nn.functional  # noqa: F401

    if dist.is_initialized():
        got = dist.get_backend()
        if backend not in str(got):
            raise ValueError(
                f"transport={backend!r} but torch.distributed was initialised with backend "
                f"{got!r}; initialise with {backend!r} or let the pipeline do it"
            )
        if backend == "nccl":
            default = dist.distributed_c10d._get_default_group()
            bind_device(getattr(default, "bound_device_id", None))
        return
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise ValueError(
            f"transport={backend!r} needs one process per stage: run under "
            "`torchrun --nproc-per-node S script.py` (or call "
            "torch.distributed.init_process_group yourself); missing environment variables "
            f"{missing}"
        )
    name = _backend_name(backend)
    if backend == "nccl":
        bind_device()
    td = datetime.timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun shares its rendezvous store with the workers across --max-restarts
        # attempts, so a restarted job would read the dead attempt's gloo/NCCL addresses
        # (pytorch/pytorch#135712): give every attempt its own key prefix
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, td
        )
        store = dist.PrefixStore(f"engine/attempt_{attempt}/", base)
        dist.init_process_group(name, store=store, rank=rank, world_size=world, timeout=td)
    else:
        dist.init_process_group(name, timeout=td)
    from engine.runtime.ranks.transport.teardown import created_default_group

    created_default_group()  # destroyed at exit, before the interpreter's finalization


def pipeline_groups(
    lines: list[list[int]], rank: int, nccl: bool, timeout: float | None = None
) -> tuple[Any, ChannelGroups]:
    """The control group and the channel groups of the pipeline (of ``lines``: every
    pipeline's global ranks in stage order, the same list on every rank) that ``rank`` is
    on. gloo: (None, {}) -- its pipeline group does both. Collective over the world: every
    rank creates every group, in the same order."""
    control: Any = None
    channels: ChannelGroups = {}
    if not nccl:
        return control, channels
    for line in lines:
        g = new_group(list(line), backend="gloo", timeout=timeout)
        if rank in line:
            control = g
        for b in range(len(line) - 1):
            pair = sorted({line[b], line[b + 1]})
            for channel in ("act", "grad"):
                g = new_group(pair, timeout=timeout)
                if rank in (line[b], line[b + 1]):
                    channels[(channel, b)] = g
    return control, channels


def make_layout(
    stages: int, replicas: int, backend: str = "gloo", timeout: float | None = None
) -> Layout:
    """Build the grid and its groups (collective: every rank must call it identically);
    ``timeout``: each group's (the pipeline's, in seconds)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if stages * replicas != world:
        raise ValueError(
            f"{stages} stages x data_parallel={replicas} replicas need {stages * replicas} "
            f"processes, but the world has {world}; run torchrun --nproc-per-node "
            f"{stages * replicas} or change data_parallel/stages"
        )
    stage, replica = rank % stages, rank // stages
    nccl = backend == "nccl"
    pipeline_group: Any = None
    dp_group: Any = None
    pipe_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    lines = [[d * stages + s for s in range(stages)] for d in range(replicas)]
    if replicas == 1:  # gloo: a group of its own, not the default one (transport/groups.py)
        pipe_ranks = tuple(range(stages))
        pipeline_group = new_group(list(pipe_ranks), timeout=timeout) if not nccl else dist.group.WORLD
    else:
        for d in range(replicas):  # every rank creates every group, in the same order
            ranks = tuple(lines[d])
            g = new_group(list(ranks), timeout=timeout)
            if d == replica:
                pipe_ranks, pipeline_group = ranks, g
        for s in range(stages):
            ranks = tuple(d * stages + s for d in range(replicas))
            g = new_group(list(ranks), timeout=timeout)
            if s == stage:
                dp_ranks, dp_group = ranks, g
    control, channels = pipeline_groups(lines, rank, nccl, timeout)
    from engine.runtime.ranks.transport.control import world_group

    world_group(timeout)  # (collective when first made: here, at the same point on every rank)
    if not dp_ranks:
        dp_ranks = (rank,)
    return Layout(
        rank,
        world,
        stages,
        replicas,
        stage,
        replica,
        pipe_ranks,
        pipeline_group,
        dp_ranks,
        dp_group,
        control_group=control if nccl else pipeline_group,
        channel_groups=channels,
    )
