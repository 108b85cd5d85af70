"""Tensor parallelism's single-process pieces (issue 27): which factories receive ``tp_mesh``,
the placement message of the handshake, and the mesh checks that need no process group."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from engine.errors import PipelineConfigError
from engine.runtime.ranks.mesh import takes_tp_mesh
from engine.runtime.tensor_parallel import _decode, _encode


def _factory(s: int, tp_mesh: Any = None) -> nn.Module:
    return nn.Linear(2, 2)


def test_only_factories_that_name_tp_mesh_receive_it() -> None:
    assert takes_tp_mesh(lambda tp_mesh: nn.Linear(2, 2))
    assert takes_tp_mesh(lambda *, tp_mesh=None: nn.Linear(2, 2))
    assert takes_tp_mesh(functools.partial(_factory, 0))
    assert not takes_tp_mesh(lambda: nn.Linear(2, 2))
    assert not takes_tp_mesh(nn.Tanh)  # a class taking **kwargs would refuse the keyword
    assert not takes_tp_mesh(lambda **kw: nn.Linear(2, 2))
    assert not takes_tp_mesh(nn.Linear(2, 2))


def test_placements_survive_the_handshake_message() -> None:
    sent = [(Shard(2),), None, (Replicate(),), (Shard(0), Replicate())]
    assert _decode(_encode(sent)) == sent
    assert _decode(_encode(None)) is None


def test_a_mesh_that_is_not_a_device_mesh_is_refused_before_anything_is_built() -> None:
    from engine import Pipeline

    with pytest.raises(PipelineConfigError, match="mesh must be a torch.distributed.device_mesh"):
        Pipeline([nn.Linear(2, 2)], schedule="gpipe", chunks=1, loss_fn=nn.functional.mse_loss,
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), transport="gloo",
                 mesh={"pp": 1})
