"""Which process runs which (replica, stage), and the process groups that connect them.

The 2-D layout of ``world = R * S`` processes (R data-parallel replicas of an S-stage
pipeline): global rank ``r`` runs stage ``r % S`` of replica ``r // S``. So with torchrun's
``--nproc-per-node`` filled node by node, consecutive ranks (usually the same node) form one
pipeline and neighbouring stages talk over the fastest links, while the gradient all-reduce
of a stage runs across replicas once per update.

Groups: one pipeline group per replica (its S ranks; point-to-point traffic and the loss
broadcast use it) and one data-parallel group per stage (its R ranks; the gradient
all-reduce). The engine creates them, under gloo the pipeline group too when there is one
replica (not the default group, which the user may also use: transport/groups.py).
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

from engine.runtime.dist.transport.groups import new_group

__all__ = ["Layout", "make_layout", "init_distributed"]


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

    @property
    def last_rank(self) -> int:
        """Global rank of this replica's last stage (it computes the loss)."""
        return self.pipeline_ranks[self.last_index]

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (computes the loss and sends it)."""
        return self.stage == self.last_index % self.stages


def init_distributed(backend: str, timeout: float) -> None:
    """Initialise the default process group from torchrun's environment, if not done yet.

    Why here: users of ``engine.Pipeline(..., transport="gloo")`` under torchrun should not
    have to remember the timeout (torch's default is 30 minutes, so a dead rank would hang
    its peers that long). An already initialised group is used as it is.
    """
    if dist.is_initialized():
        got = dist.get_backend()
        if backend not in str(got):
            raise ValueError(
                f"transport={backend!r} but torch.distributed was initialised with backend "
                f"{got!r}; initialise with {backend!r} or let the pipeline do it"
            )
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
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    td = datetime.timedelta(seconds=timeout)
    # imported before the group exists, so that its functions' default ``group=group.WORLD``
    # binds None, not the live group (which would then outlive destroy_process_group at exit,
    # gloo threads and all: teardown.release_captured_world)
    import torch.distributed.nn.functional  # noqa: F401

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
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
    else:
        dist.init_process_group(backend, timeout=td)
    from engine.runtime.dist.transport.teardown import created_default_group

    created_default_group()  # destroyed at exit, before the interpreter's finalization


def make_layout(stages: int, replicas: int) -> Layout:
    """Build the grid and its groups (collective: every rank must call it identically)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if stages * replicas != world:
        raise ValueError(
            f"{stages} stages x data_parallel={replicas} replicas need {stages * replicas} "
            f"processes, but the world has {world}; run torchrun --nproc-per-node "
            f"{stages * replicas} or change data_parallel/stages"
        )
    stage, replica = rank % stages, rank // stages
    pipeline_group: Any = None
    dp_group: Any = None
    pipe_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    if replicas == 1:  # gloo: a group of its own, not the default one (transport/groups.py)
        pipe_ranks = tuple(range(stages))
        gloo = dist.get_backend() == "gloo"
        pipeline_group = new_group(list(pipe_ranks)) if gloo else dist.group.WORLD
    else:
        for d in range(replicas):  # every rank creates every group, in the same order
            ranks = tuple(d * stages + s for s in range(stages))
            g = new_group(list(ranks))
            if d == replica:
                pipe_ranks, pipeline_group = ranks, g
        for s in range(stages):
            ranks = tuple(d * stages + s for d in range(replicas))
            g = new_group(list(ranks))
            if s == stage:
                dp_ranks, dp_group = ranks, g
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
    )
