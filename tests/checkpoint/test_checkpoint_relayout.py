"""Checkpoints that move between layouts (one process): saved at S=4, loaded at S=2, S=1 and
another split, gpipe and 1f1b, SGD with momentum and AdamW: the continuation equals the S=4
one bit for bit. Stage factories declare their model names with ``engine.named_stage``.
Every refusal (micro-batches in flight, another update rule, a missing name, stages without
names, other hyper-parameters) names both layouts and the fix, and changes nothing.
Checkpoints written before names were recorded still load into their own layout.

The multi-process cases (gloo, tensor parallelism) are in test_checkpoint_relayout_dist.py;
export and plain state_dict files in test_export.py."""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from typing import Any

import pytest
import torch
from relayout_support import OPTIMIZERS, K, N, balance, batch, model, pipe, run, same
from torch import nn

import engine
import engine.optim as eo
from engine.errors import CheckpointError, PipelineConfigError


def _saved(tmp_path: Any, S: int = 4, schedule: str = "1f1b", opt: str = "sgd",
           **kw: Any) -> tuple[engine.Pipeline, str]:
    a = pipe(S, schedule, opt, **kw)
    run(a, range(K))
    path = str(tmp_path / "ckpt.safetensors")
    engine.save(a, path)
    return a, path


def _state(p: engine.Pipeline) -> list[torch.Tensor]:
    out = []
    for st in p.stages:
        out += [t.detach().clone() for t in st.module.state_dict().values()]
        for s in st.optimizer.state.values():
            out += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _unchanged(before: list[torch.Tensor], p: engine.Pipeline) -> bool:
    after = _state(p)
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_saved_at_four_stages_continues_bitwise_at_two_and_one(tmp_path: Any, opt: str, schedule: str) -> None:
    a, path = _saved(tmp_path, 4, schedule, opt)
    run(a, range(K, N))
    ref = engine.export(a)
    other = "gpipe" if schedule == "1f1b" else "1f1b"  # the same update rule
    for S, sched, split in ((2, schedule, None), (1, other, None), (3, other, [1, 3, 4])):
        b = engine.Pipeline(model(), balance=split or balance(S), schedule=sched, chunks=2,
                            loss_fn=nn.functional.mse_loss, optimizer=OPTIMIZERS[opt])
        engine.load(b, path)
        assert b.steps == K and all(st.updates == K for st in b.stages)
        run(b, range(K, N))
        assert same(engine.export(b), ref), (S, sched, split)
    fresh = pipe(2, schedule, opt)  # the control: without the checkpoint the run differs
    run(fresh, range(K, N))
    assert not same(engine.export(fresh), ref)


def test_optimizer_state_lands_on_the_new_stages(tmp_path: Any) -> None:
    """Adam's moments and step count of layer 4 sit at stage 2 of 4 and at stage 1 of 2."""
    a, path = _saved(tmp_path, 4, "1f1b", "adamw")
    b = pipe(2, "1f1b", "adamw")
    engine.load(b, path)
    (pa,) = [p for n, p in a.stages[2].module.named_parameters() if n == "4.weight"]
    (pb,) = [p for n, p in b.stages[1].module.named_parameters() if n == "4.weight"]
    sa, sb = a.stages[2].optimizer.state, b.stages[1].optimizer.state
    qa = [q for g in a.stages[2].optimizer.param_groups for q in g["params"]]
    qb = [q for g in b.stages[1].optimizer.param_groups for q in g["params"]]
    ia = [id(p) for p in a.stages[2].store.params].index(id(pa))
    ib = [id(p) for p in b.stages[1].store.params].index(id(pb))
    ea, eb = sa[qa[ia]], sb[qb[ib]]
    assert set(ea) == set(eb) >= {"exp_avg", "exp_avg_sq", "step"}
    for key in ea:
        assert torch.equal(ea[key], eb[key]), key
    assert torch.equal(pa, pb)


def test_a_flushed_asynchronous_checkpoint_moves(tmp_path: Any) -> None:
    a = pipe(4, "pipedream", "sgd")
    run(a, range(3))  # (run flushes)
    path = str(tmp_path / "c.safetensors")
    engine.save(a, path)
    b = pipe(2, "pipedream", "sgd")
    engine.load(b, path)
    assert same(engine.export(b), engine.export(a)) and b.steps == 3
    run(b, range(3, 5))
    assert b.steps == 5


def test_named_stage_factories_move_to_a_sequential(tmp_path: Any) -> None:
    """Factories declare their names (a prefix, a mapping, a function): saved at S=2, loaded
    into the whole model as one nn.Sequential stage, bit for bit."""
    whole = model()
    layers = dict(whole.named_children())

    class Half(nn.Module):  # its own attribute names, mapped to the model's
        def __init__(self, lo: int) -> None:
            super().__init__()
            self.body = nn.ModuleList(copyof(layers[str(i)]) for i in range(lo, lo + 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for m in self.body:
                x = m(x)
            return x

    def copyof(m: nn.Module) -> nn.Module:
        import copy

        return copy.deepcopy(m)

    first = engine.named_stage(lambda: Half(0), {f"body.{j}": str(j) for j in range(4)})
    second = engine.named_stage(lambda: Half(4), lambda name: str(4 + int(name.split(".")[1])) + name[len("body.0"):])
    kw: dict[str, Any] = dict(schedule="1f1b", chunks=2, loss_fn=nn.functional.mse_loss,
                              optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9))
    a = engine.Pipeline([first, second], **kw)
    run(a, range(K))
    path = str(tmp_path / "f.safetensors")
    engine.save(a, path)
    run(a, range(K, N))
    b = engine.Pipeline(model(), balance=[8], **kw)
    engine.load(b, path)
    run(b, range(K, N))
    assert same(engine.export(b), engine.export(a))
    assert sorted(engine.export(a)) == sorted(whole.state_dict())
    prefixed = engine.named_stage(nn.Sequential(OrderedDict([("0", nn.Linear(6, 6))])), "encoder")
    assert engine.export(engine.Pipeline([prefixed], **kw)).keys() == {"encoder.0.weight", "encoder.0.bias"}


def test_a_naming_that_misses_a_tensor_is_refused_at_build() -> None:
    stage = engine.named_stage(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)), {"0": "layers.0"})
    with pytest.raises(PipelineConfigError, match=r"stage 0: '1.weight' has no name in the model"):
        engine.Pipeline([stage], schedule="gpipe", chunks=2, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: eo.SGD(p, lr=0.1))
    with pytest.raises(PipelineConfigError, match="both get the model name 'x'"):
        engine.Pipeline([engine.named_stage(nn.Linear(6, 3), lambda n: "x")], schedule="gpipe",
                        chunks=2, loss_fn=nn.functional.mse_loss, optimizer=lambda p: eo.SGD(p, lr=0.1))


# ------------------------------------------------------------------------------ refusals


def _refused(make: Any, path: str, *needles: str, **kw: Any) -> str:
    p = make()
    run(p, range(1))  # a trained pipeline: a refused load must leave its state as it is
    before = _state(p)
    with pytest.raises(CheckpointError) as info:
        engine.load(p, path, **kw)
    assert _unchanged(before, p) and p.steps == 1
    for n in needles:
        assert n in str(info.value), (n, str(info.value))
    return str(info.value)


def test_an_unflushed_asynchronous_checkpoint_loads_only_into_its_own_layout(tmp_path: Any) -> None:
    a = pipe(4, "pipedream", "sgd")
    for t in range(3):
        a.step(*batch(t))
    path = str(tmp_path / "u.safetensors")
    engine.save(a, path)
    _refused(lambda: pipe(2, "pipedream", "sgd"), path, "4 stages of 'pipedream', one process",
             "2 stages of 'pipedream', one process", "saved unflushed", "pipe.flush() before engine.save",
             "load it into a pipeline of the layout that wrote it", "nothing was loaded")
    b = pipe(4, "pipedream", "sgd")  # its own layout: the in-flight state comes back
    engine.load(b, path)
    assert not b.flushed


def test_another_update_rule_is_refused(tmp_path: Any) -> None:
    _, path = _saved(tmp_path, 4, "gpipe")
    _refused(lambda: pipe(2, "pb", "sgd"), path, "another update rule", "checkpoint synchronous",
             "'pb'", "4 stages of 'gpipe'", "2 stages of 'pb'")


def test_a_missing_name_is_refused(tmp_path: Any) -> None:
    _, path = _saved(tmp_path, 4)
    bigger = nn.Sequential(*model(), nn.Linear(3, 3))  # layer 8 is not in the checkpoint
    make = lambda: engine.Pipeline(bigger, balance=[5, 4], schedule="1f1b", chunks=2,  # noqa: E731
                                   loss_fn=nn.functional.mse_loss,
                                   optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9))
    _refused(make, path, "it lacks ['8.bias', '8.weight']", "4 stages of '1f1b'", "2 stages of '1f1b'")


def test_other_hyperparameters_are_refused_unless_overridden(tmp_path: Any) -> None:
    _, path = _saved(tmp_path, 4)
    make = lambda: engine.Pipeline(model(), balance=balance(2), schedule="1f1b", chunks=2,  # noqa: E731
                                   loss_fn=nn.functional.mse_loss,
                                   optimizer=lambda p: eo.SGD(p, lr=0.2, momentum=0.9))
    _refused(make, path, "param_groups[0]['lr']: checkpoint 0.05 vs pipeline 0.2")
    b = make()
    engine.load(b, path, override_hyperparameters=True)
    assert b.stages[0].optimizer.param_groups[0]["lr"] == 0.05


def _hand_made(S: int) -> list[nn.Module]:
    whole = model()
    cut = balance(S)
    out, i = [], 0
    for n in cut:
        out.append(nn.Sequential(*list(whole)[i : i + n]))
        i += n
    return out


def test_stages_without_names_say_how_to_declare_them(tmp_path: Any) -> None:
    kw: dict[str, Any] = dict(schedule="1f1b", chunks=2, loss_fn=nn.functional.mse_loss,
                              optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9))
    a = engine.Pipeline(_hand_made(4), **kw)
    run(a, range(K))
    path = str(tmp_path / "h.safetensors")
    engine.save(a, path)
    _refused(lambda: engine.Pipeline(_hand_made(2), **kw), path,
             "stages: checkpoint 4 vs pipeline 2", "engine.named_stage(stage_or_factory")
    _refused(lambda: pipe(2, "1f1b", "sgd"), path, "records no names in the whole model",
             "4 stages of '1f1b'", "engine.named_stage(")
    _, named = _saved(tmp_path, 4)  # named checkpoint, hand-made pipeline of another layout
    _refused(lambda: engine.Pipeline(_hand_made(2), **kw), named, "engine.named_stage(")
    b = engine.Pipeline(_hand_made(4), **kw)  # the same layout: loads as it always did
    engine.load(b, path)
    assert b.steps == K


# ------------------------------------------------------------------------------ older files


def _rewrite(path: str, edit: Any) -> None:
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


def test_a_checkpoint_written_before_names_loads_into_its_own_layout_only(tmp_path: Any) -> None:
    """What the engine wrote before names were recorded: format 2, no "names"."""
    from safetensors.torch import load_file

    from engine import serialization

    a, path = _saved(tmp_path, 4)

    def as_before(meta: dict[str, Any]) -> None:
        for pair in meta["state"]["__dict__"]:
            if pair[0] == "stages":
                for sd in pair[1]:
                    sd["__dict__"] = [kv for kv in sd["__dict__"] if kv[0] != "names"]
        meta["state"]["__dict__"] = [kv for kv in meta["state"]["__dict__"] if kv[0] != "update_rule"]
        meta["format"] = "engine.pipeline/2"
        del meta["tensors"]
        meta["sha256"] = serialization._digest(load_file(path), meta["state"])

    _rewrite(path, as_before)
    b = pipe(4, "1f1b", "sgd")
    engine.load(b, path)
    assert same(engine.export(b), engine.export(a))
    _refused(lambda: pipe(2, "1f1b", "sgd"), path, "records no names", "stages: checkpoint 4 vs pipeline 2")


def test_a_damaged_tensor_is_named_when_only_part_is_read(tmp_path: Any) -> None:
    _, path = _saved(tmp_path, 4)
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0xFF
    with open(path, "wb") as f:
        f.write(raw)
    _refused(lambda: pipe(2, "1f1b", "sgd"), path, "does not match its SHA-256")
    assert os.path.exists(path)


def _grouped(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Two param groups (weights decay, biases do not); the output layer's group runs at
    twice the lr, so the groups of another cut mix saved groups of two lrs."""
    lr = 0.02 if any(p.shape[0] == 3 for p in params) else 0.01
    w, b = [p for p in params if p.ndim > 1], [p for p in params if p.ndim == 1]
    return eo.AdamW([{"params": w, "weight_decay": 0.1}, {"params": b, "weight_decay": 0.0}], lr=lr)


def _scheduled(S: int, schedule: str = "1f1b", opt: Any = None) -> engine.Pipeline:
    return engine.Pipeline(model(), balance=balance(S), schedule=schedule, chunks=2,
                           loss_fn=nn.functional.mse_loss, optimizer=opt or OPTIMIZERS["adamw"],
                           lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5))


def test_param_groups_and_lr_schedulers_move(tmp_path: Any) -> None:
    a = _scheduled(4, opt=lambda p: eo.AdamW(
        [{"params": [q for q in p if q.ndim > 1], "weight_decay": 0.1},
         {"params": [q for q in p if q.ndim == 1], "weight_decay": 0.0}], lr=0.01))
    run(a, range(3))
    path = str(tmp_path / "s.safetensors")
    engine.save(a, path)
    run(a, range(3, 7))
    for S in (2, 1):
        b = _scheduled(S, "gpipe", opt=lambda p: eo.AdamW(
            [{"params": [q for q in p if q.ndim > 1], "weight_decay": 0.1},
             {"params": [q for q in p if q.ndim == 1], "weight_decay": 0.0}], lr=0.01))
        engine.load(b, path)
        assert b.stages[0].scheduler.last_epoch == 3
        run(b, range(3, 7))
        assert same(engine.export(b), engine.export(a)), S
        assert b.stages[-1].optimizer.param_groups[1]["lr"] == 0.01 * 0.5**3  # decayed at 4 and 6


def test_saved_groups_that_disagree_are_refused_unless_overridden(tmp_path: Any) -> None:
    a = _scheduled(4, opt=_grouped)
    run(a, range(2))
    path = str(tmp_path / "g.safetensors")
    engine.save(a, path)
    msg = _refused(lambda: _scheduled(2, opt=_grouped), path, "param group 0 of stage 1",
                   "hyper-parameters differ", "override_hyperparameters=True")
    assert "lr" in msg
    b = _scheduled(2, opt=_grouped)
    engine.load(b, path, override_hyperparameters=True)
    assert b.stages[1].optimizer.param_groups[0]["lr"] == 0.02 and b.steps == 2


def _named_state(p: engine.Pipeline) -> dict[str, dict[str, torch.Tensor]]:
    """Per model name, its optimizer state and the runtime's delta (torch optimizers)."""
    from engine.runtime.state.model_index import stage_record

    out: dict[str, dict[str, torch.Tensor]] = {}
    for st in p.stages:
        rec = stage_record(p.parts, st)
        opt = st.optimizer
        params = [q for g in opt.param_groups for q in g["params"]]
        extra = st.bridge.extra_state()
        for i, names in enumerate(rec["params"]):
            entry = {k: v.clone() for k, v in opt.state.get(params[i], {}).items() if isinstance(v, torch.Tensor)}
            if f"delta.{i}" in extra:
                entry["runtime_delta"] = extra[f"delta.{i}"].clone()
            out[names[0]] = entry
    return out


@pytest.mark.parametrize("case", ["engine-sc-t2", "torch-runtime-t2"])
def test_the_mitigations_per_parameter_buffers_move(tmp_path: Any, case: str) -> None:
    """pb flushed at S=4, loaded at S=2: SC's and PipeMare's per-parameter buffers (the
    optimizer's own delta, or the runtime's for a torch optimizer) land by model name."""
    if case == "engine-sc-t2":
        kw: dict[str, Any] = dict(optimizer=lambda p: eo.SGD(p, lr=0.05, momentum=0.9,
                                                             spike_compensation=True,
                                                             discrepancy_correction=True))
    else:
        kw = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), discrepancy_correction=True)

    def make(S: int) -> engine.Pipeline:
        return engine.Pipeline(model(), balance=balance(S), schedule="pb", chunks=2,
                               loss_fn=nn.functional.mse_loss, **kw)

    a = make(4)
    run(a, range(3))
    path = str(tmp_path / "m.safetensors")
    engine.save(a, path)
    saved = _named_state(a)
    assert any("delta" in k for e in saved.values() for k in e)
    b = make(2)
    engine.load(b, path)
    got = _named_state(b)
    assert got.keys() == saved.keys()
    for name, entry in saved.items():
        assert entry.keys() <= got[name].keys(), name
        for key, t in entry.items():
            assert torch.equal(t, got[name][key]), (name, key)
        for key in got[name].keys() - entry.keys():  # kept by none of the saved stages (delay 0)
            assert key == "runtime_delta" and not got[name][key].any(), (name, key)
    run(b, range(3, 5))
    assert b.steps == 5
