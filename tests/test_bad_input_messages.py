"""Bad inputs whose messages must name the culprit: each gets an error saying what is wrong
and changes nothing -- an out-of-range class label (the stage and the micro-batch), a plain
function as a stage, engine.save into a missing folder (the user's path), spike_compensation
on a synchronous schedule (refused like delay_compensation), and the message slips (a batch
size suggestion, a corrupted format field, a 1-D input, the tie error's schedule list)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import pytest
import torch
from torch import nn

import engine
import engine.optim as eo
from engine import Pipeline
from engine.errors import CheckpointError, PipelineConfigError, PipelineInputError


def _stages(out: int = 5) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, out)]


def _pipe(schedule: str = "1f1b", loss: Any = nn.functional.mse_loss, **kw: Any) -> Pipeline:
    kw.setdefault("optimizer", lambda p: eo.SGD(p, lr=0.1, momentum=0.9))
    return Pipeline(_stages(), schedule=schedule, chunks=4, loss_fn=loss, **kw)


def _state(pipe: Pipeline) -> list[torch.Tensor]:
    out = [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]
    for st in pipe.stages:
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_out_of_range_label_names_stage_and_micro_batch(schedule: str) -> None:
    pipe = _pipe(schedule, loss=nn.functional.cross_entropy)
    x = torch.randn(8, 16)
    pipe.step(x, torch.zeros(8, dtype=torch.long))
    before = _state(pipe)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 7, 1])  # 7 >= 5 classes: micro-batch 1 + 4 = 5
    with pytest.raises(PipelineInputError, match=r"stage 1's loss_fn failed on micro-batch 7: "
                       r"IndexError: .*out of bounds.*of the 5 classes"):
        pipe.step(x, labels)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(pipe), strict=True))
    pipe.step(x, torch.zeros(8, dtype=torch.long))  # the pipeline goes on


def test_plain_function_as_stage_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="stage 0 is not a module or a factory: tanh"):
        Pipeline([torch.tanh, nn.Linear(16, 5)], schedule="1f1b", chunks=4,
                 loss_fn=nn.functional.mse_loss, optimizer=lambda p: eo.SGD(p, lr=0.1))


def test_factory_raising_type_error_inside_is_not_mistaken() -> None:
    def factory() -> nn.Module:
        return nn.Linear(16)  # type: ignore[call-arg]  # the user's bug, inside the factory

    with pytest.raises(TypeError, match="out_features"):
        Pipeline([factory, nn.Linear(16, 5)], schedule="1f1b", chunks=4,
                 loss_fn=nn.functional.mse_loss, optimizer=lambda p: eo.SGD(p, lr=0.1))


def test_save_into_a_missing_folder_names_the_path(tmp_path: Any) -> None:
    pipe = _pipe()
    target = tmp_path / "missing" / "ckpt.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        engine.save(pipe, target)
    assert str(target) in str(info.value) and "does not exist" in str(info.value)
    assert ".tmp-" not in str(info.value)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "naive"])
def test_spike_compensation_on_a_synchronous_schedule_is_refused(schedule: str) -> None:
    stages = _stages()
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(PipelineConfigError, match="spike_compensation=True .* has no delay"):
        Pipeline(stages, schedule=schedule, chunks=4, loss_fn=nn.functional.mse_loss,
                 optimizer=lambda p: eo.SGD(p, lr=0.1, momentum=0.9, spike_compensation=True))
    after = [p.detach() for m in stages for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_batch_size_suggestion_does_not_repeat() -> None:
    with pytest.raises(PipelineInputError) as info:
        _pipe().step(torch.randn(2, 16), torch.randn(2, 5))
    assert "e.g. 4)" in str(info.value) and "4 or 4" not in str(info.value)


def test_one_dimensional_input_says_dim_0_is_the_batch() -> None:
    with pytest.raises(PipelineInputError, match=r"1-D: dim 0 is the batch.*unsqueeze\(0\)"):
        _pipe().step(torch.randn(16), torch.randn(16, 5))


def _rewrite_format(path: Any, fmt: Any) -> None:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["engine"])
    meta["format"] = fmt
    header["__metadata__"]["engine"] = json.dumps(meta)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data[8 + n :])


@pytest.mark.parametrize("fmt,newer", [("engine.pipeline/9", True), ("engXne.pip\x00", False),
                                       (None, False), (7, False)])
def test_corrupted_format_is_not_called_newer(tmp_path: Any, fmt: Any, newer: bool) -> None:
    pipe = _pipe()
    path = os.path.join(tmp_path, "c.safetensors")
    engine.save(pipe, path)
    _rewrite_format(path, fmt)
    with pytest.raises(CheckpointError) as info:
        engine.load(_pipe(), path)
    assert ("a newer engine wrote it?" in str(info.value)) == newer, str(info.value)
    if not newer:
        assert "corrupted" in str(info.value)
