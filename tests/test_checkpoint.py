"""Checkpoints: bit-identical resume for every schedule, atomic safetensors files, clear errors
for corrupted / truncated / mismatched files with nothing changed, and no pickle on load."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.errors import CheckpointError, NotFlushedError
from engine.serialization import load, save

optim = pytest.importorskip("engine.optim")

CONFIGS = {
    "naive": dict(schedule="naive"),
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "pipedream": dict(schedule="pipedream"),
    "2bw": dict(schedule="2bw"),
    "pb": dict(schedule="pb"),
    "pb-1f1b-k2": dict(schedule="pb", order="1f1b", update_size=2),
    "pb-lwp": dict(schedule="pb", opt=dict(prediction="linear")),
    "pb-spectrain": dict(schedule="pb", weight_prediction="spectrain", opt=dict(prediction="linear")),
    "pb-t2": dict(schedule="pb", opt=dict(discrepancy_correction=True)),
    "pb-sc-pipemarelr": dict(schedule="pb", opt=dict(spike_compensation=True), sched=True),
}


def _stages(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.2), nn.Tanh()),  # dropout: RNG must resume too
        nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 1)),
    ]


def _pipe(name: str, seed: int = 0) -> Pipeline:
    cfg = dict(CONFIGS[name])
    opt_kw = cfg.pop("opt", {})
    sched = cfg.pop("sched", False)
    adam = name in ("gpipe", "2bw")

    def make(p):
        if adam:
            return optim.Adam(p, lr=1e-2, **opt_kw)
        return optim.SGD(p, lr=0.05, momentum=0.9, **opt_kw)

    return Pipeline(
        _stages(seed),
        chunks=3,
        loss_fn=nn.functional.mse_loss,
        optimizer=make,
        lr_scheduler=(lambda o: optim.PipeMareLR(o, 5)) if sched else None,
        **cfg,
    )


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def _weights(pipe: Pipeline) -> list[torch.Tensor]:
    return [t.detach().clone() for st in pipe.stages for t in st.module.state_dict().values()]


def _opt_state(pipe: Pipeline) -> list[torch.Tensor]:
    out = []
    for st in pipe.stages:
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_is_bit_identical(name: str, tmp_path) -> None:
    data = _data(6)
    k = 3
    torch.manual_seed(123)
    a = _pipe(name)
    losses_a = [a.step(x, y) for x, y in data[:k]]
    a.flush()
    path = tmp_path / "ckpt.safetensors"
    save(a, path)
    losses_a += [a.step(x, y) for x, y in data[k:]]
    a.flush()

    b = _pipe(name, seed=99)  # different init: everything must come from the file
    load(b, path)
    losses_b = [b.step(x, y) for x, y in data[k:]]
    b.flush()
    for wa, wb in zip(_weights(a), _weights(b), strict=True):
        assert torch.equal(wa, wb)
    for la, lb in zip(losses_a[k:], losses_b, strict=True):
        assert torch.equal(la, lb)
    assert b.steps == a.steps
    for sa, sb in zip(_opt_state(a), _opt_state(b), strict=True):
        assert torch.equal(sa, sb)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_state_dict_roundtrip_and_not_flushed() -> None:
    a = _pipe("pipedream")
    for x, y in _data(2):
        a.step(x, y)
    with pytest.raises(NotFlushedError, match="flush"):
        a.state_dict()
    a.flush()
    b = _pipe("pipedream", seed=5)
    b.load_state_dict(a.state_dict())
    for wa, wb in zip(_weights(a), _weights(b), strict=False):
        assert torch.equal(wa, wb)
    b.step(*_data(1)[0])
    with pytest.raises(NotFlushedError):
        b.load_state_dict(a.state_dict())


def _saved(tmp_path) -> tuple[Pipeline, str]:
    a = _pipe("1f1b")
    for x, y in _data(2):
        a.step(x, y)
    path = str(tmp_path / "c.safetensors")
    save(a, path)
    return a, path


def test_file_is_safetensors_with_json_metadata(tmp_path) -> None:
    from safetensors import safe_open

    _, path = _saved(tmp_path)
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["engine"])
        assert meta["format"] == "engine.pipeline/1"
        assert any(k.startswith("s.stages.0.module") for k in f.keys())
    assert "sha256" in meta


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "header"])
def test_corrupted_checkpoint_changes_nothing(damage: str, tmp_path) -> None:
    _, path = _saved(tmp_path)
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) - 7]
    elif damage == "flip":
        raw[-3] ^= 0xFF  # inside the tensor data: only the checksum can tell
    elif damage == "garbage":
        raw = bytearray(b"not a checkpoint at all" * 3)
    elif damage == "empty":
        raw = bytearray()
    else:
        (n,) = struct.unpack("<Q", raw[:8])
        raw[8 + n // 2] = ord("}")
    with open(path, "wb") as f:
        f.write(raw)
    b = _pipe("1f1b", seed=3)
    before = _weights(b)
    with pytest.raises(CheckpointError, match="corrupted|truncated|not an engine"):
        load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(b), strict=False))
    assert b.steps == 0


def test_mismatched_checkpoint_changes_nothing(tmp_path) -> None:
    _, path = _saved(tmp_path)
    b = _pipe("gpipe", seed=3)
    before = _weights(b)
    with pytest.raises(CheckpointError, match="schedule: checkpoint '1f1b' vs pipeline 'gpipe'"):
        load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(b), strict=False))
    with pytest.raises(CheckpointError, match="cannot read"):
        load(b, str(tmp_path / "missing.safetensors"))


def test_save_replaces_atomically(tmp_path) -> None:
    a, path = _saved(tmp_path)
    a.step(*_data(1)[0])
    save(a, path)  # overwrite in place via os.replace
    b = _pipe("1f1b", seed=4)
    load(b, path)
    assert b.steps == 3
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]
