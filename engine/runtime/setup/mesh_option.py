"""The ``mesh=`` option checked with the other options, before anything is built.

Why apart from :mod:`engine.runtime.ranks.mesh`: checking an option is the configuration's job
(engine/runtime/setup/config.py), which sits below the multi-process code that lays ranks out on
the mesh; this module needs only torch and the mesh's names and sizes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from engine.errors import PipelineConfigError

__all__ = ["MESH_DIMS", "check_mesh", "mesh_sizes"]

#: the dimension names the engine reads; any other name is refused
MESH_DIMS = ("pp", "dp", "tp")


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """{pp, dp, tp} of a DeviceMesh with named dimensions (a missing dp or tp has size 1)."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise PipelineConfigError(
            "mesh has no dimension names; build it with init_device_mesh(device_type, shape, "
            f"mesh_dim_names=...) naming each dimension one of {list(MESH_DIMS)} ('pp' required)"
        )
    shape = tuple(mesh.mesh.shape)
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise PipelineConfigError(
            f"mesh dimension(s) {unknown} are not pipeline dimensions; name each dimension one of "
            f"{list(MESH_DIMS)} (pp: pipeline ranks, dp: data-parallel replicas, tp: tensor "
            "parallelism inside a stage)"
        )
    if "pp" not in names:
        raise PipelineConfigError(
            f"mesh dimensions {list(names)} have no 'pp' (the pipeline ranks); name one "
            "dimension 'pp'"
        )
    return {n: int(shape[names.index(n)]) if n in names else 1 for n in MESH_DIMS}


def check_mesh(mesh: Any, transport: str, data_parallel: int) -> dict[str, int]:
    """The mesh's sizes {pp, dp, tp}, checked against the options and the world (before
    anything is built: the error changes nothing)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise PipelineConfigError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh (from init_device_mesh), "
            f"got {type(mesh).__name__}"
        )
    if transport not in ("gloo", "nccl"):
        raise PipelineConfigError(
            f"mesh= needs one process per mesh position: use transport='gloo' or 'nccl' under "
            f"torchrun, not transport={transport!r}"
        )
    sizes = mesh_sizes(mesh)
    if data_parallel not in (1, sizes["dp"]):
        raise PipelineConfigError(
            f"data_parallel={data_parallel} disagrees with the mesh's dp dimension of size "
            f"{sizes['dp']}; with a mesh leave data_parallel out (the mesh says it)"
        )
    world = dist.get_world_size() if dist.is_initialized() else None
    total = sizes["pp"] * sizes["dp"] * sizes["tp"]
    if world is not None and (mesh.mesh.numel() != world or total != world):
        raise PipelineConfigError(
            f"the mesh (pp={sizes['pp']} x dp={sizes['dp']} x tp={sizes['tp']} = {total} "
            f"positions) does not cover the world of {world} processes; the pipeline's mesh "
            "must hold every rank once"
        )
    return sizes
