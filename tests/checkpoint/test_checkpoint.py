"""Checkpoints: bit-identical resume for every schedule, atomic safetensors files, clear errors
for corrupted / truncated / mismatched files with nothing changed, and no pickle on load."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from torch import nn

import engine.optim as optim
from engine import Pipeline
from engine.errors import CheckpointError, NotFlushedError
from engine.serialization import load, save


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
    "pipedream-dc": dict(schedule="pipedream", opt=dict(delay_compensation=2.0)),  # own delta
    "pb-sc-pipemarelr": dict(schedule="pb", opt=dict(spike_compensation=True), sched=True),
    "2bw-muon": dict(schedule="2bw", muon=True),
    "pb-muon-lwp": dict(schedule="pb", muon=True, opt=dict(prediction="linear")),
    "pb-muon-t2": dict(schedule="pb", muon=True, opt=dict(discrepancy_correction=True)),
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
    muon = cfg.pop("muon", False)
    adam = name in ("gpipe", "2bw")

    def make(p):
        if muon:
            return optim.Muon(p, lr=1e-2, adamw_lr=1e-2, **opt_kw)
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
        assert meta["format"] == "engine.pipeline/3"
        assert any(k.startswith("s.stages.0.module") for k in f.keys())
        assert set(meta["tensors"]) == set(f.keys())  # each tensor's own SHA-256
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
        i = 8 + n // 2
        while raw[i] == ord("}"):  # make sure the byte really changes
            i += 1
        raw[i] = ord("}")
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


# ----------------------------------------------------------------------------- integrity


def _rewrite_metadata(path: str, edit) -> None:
    """Rewrite the JSON metadata of a safetensors file (tensors untouched)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["engine"])
    edit(meta)
    header["__metadata__"]["engine"] = json.dumps(meta)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def _find(obj, key):
    """The first [key, value] pair of the metadata skeleton's dicts with this key."""
    if isinstance(obj, dict):
        for k, v in obj.get("__dict__", []):
            if k == key:
                return obj["__dict__"][[kk for kk, _ in obj["__dict__"]].index(k)]
            found = _find(v, key)
            if found is not None:
                return found
    if isinstance(obj, list):
        for v in obj:
            found = _find(v, key)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("key,value", [("lr", 0.5), ("updates", 99), ("steps", 7)])
def test_hand_edited_metadata_fails_the_checksum(key: str, value, tmp_path) -> None:
    _, path = _saved(tmp_path)

    def edit(meta):
        pair = _find(meta["state"], key)
        assert pair is not None, key
        pair[1] = value

    _rewrite_metadata(path, edit)
    b = _pipe("1f1b", seed=3)
    before = _weights(b)
    with pytest.raises(CheckpointError, match="tensor data or metadata does not match its SHA-256"):
        load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(b), strict=True))


def test_format_2_files_still_load(tmp_path) -> None:
    """Format 2 (one checksum over the JSON and every tensor, no per-tensor sums)."""
    from engine import serialization

    a, path = _saved(tmp_path)

    def as_format_2(meta):
        from safetensors.torch import load_file

        meta["format"] = "engine.pipeline/2"
        del meta["tensors"]
        meta["sha256"] = serialization._digest(load_file(path), meta["state"])

    _rewrite_metadata(path, as_format_2)
    b = _pipe("1f1b", seed=3)
    load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b), strict=True))
    _rewrite_metadata(path, lambda meta: _find(meta["state"], "lr").__setitem__(1, 0.5))
    with pytest.raises(CheckpointError, match="tensor data or metadata does not match its SHA-256"):
        load(_pipe("1f1b", seed=3), path)


def test_format_1_files_still_load_and_unknown_formats_fail_clearly(tmp_path) -> None:
    from engine import serialization

    a, path = _saved(tmp_path)

    def as_format_1(meta):
        from safetensors.torch import load_file

        meta["format"] = "engine.pipeline/1"
        del meta["tensors"]
        meta["sha256"] = serialization._digest(load_file(path))  # format 1: tensors only

    _rewrite_metadata(path, as_format_1)
    b = _pipe("1f1b", seed=3)
    load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b), strict=True))
    _rewrite_metadata(path, lambda meta: meta.update(format="engine.pipeline/9"))
    with pytest.raises(CheckpointError, match="has format 'engine.pipeline/9'; this engine reads 'engine.pipeline/1' and 'engine.pipeline/2'"):
        load(_pipe("1f1b", seed=3), path)


def test_another_optimizer_type_is_refused(tmp_path) -> None:
    _, path = _saved(tmp_path)  # SGD
    b = Pipeline(_stages(3), chunks=3, loss_fn=nn.functional.mse_loss, schedule="1f1b",
                 optimizer=lambda p: optim.AdamW(p, lr=0.05))
    before = _weights(b)
    with pytest.raises(CheckpointError, match=r"stage 0: the checkpoint's optimizer is engine\.optim\.sgd\.SGD, the pipeline's engine\.optim\.adam\.AdamW"):
        load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(b), strict=True))


def test_other_hyperparameters_are_refused_unless_overridden(tmp_path) -> None:
    _, path = _saved(tmp_path)  # lr 0.05, momentum 0.9
    b = Pipeline(_stages(3), chunks=3, loss_fn=nn.functional.mse_loss, schedule="1f1b",
                 optimizer=lambda p: optim.SGD(p, lr=0.2, momentum=0.9))
    before = _weights(b)
    with pytest.raises(CheckpointError, match=r"param_groups\[0\]\['lr'\]: checkpoint 0\.05 vs pipeline 0\.2.*override_hyperparameters=True"):
        load(b, path)
    assert all(torch.equal(x, y) for x, y in zip(before, _weights(b), strict=True))
    load(b, path, override_hyperparameters=True)
    assert b.stages[0].optimizer.param_groups[0]["lr"] == 0.05  # the checkpoint's, as torch


def test_a_scheduled_learning_rate_is_not_a_mismatch(tmp_path) -> None:
    """An LR scheduler owns lr: a checkpoint after a decay loads into a fresh pipeline."""
    def make():
        return Pipeline(_stages(0), chunks=3, loss_fn=nn.functional.mse_loss, schedule="1f1b",
                        optimizer=lambda p: optim.SGD(p, lr=0.1, momentum=0.9),
                        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
    a = make()
    for x, y in _data(2):
        a.step(x, y)
    save(a, tmp_path / "c")
    b = make()
    load(b, tmp_path / "c")
    assert b.stages[0].optimizer.param_groups[0]["lr"] == a.stages[0].optimizer.param_groups[0]["lr"]
