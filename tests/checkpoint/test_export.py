"""``engine.export`` and starting a pipeline from a plain ``state_dict`` file.

A synchronous pipeline's export equals the same model trained unpipelined, bit for bit (and
the export of its checkpoint equals the export of the pipeline); a GPT-2 split by
``split_causal_lm`` exports the Hugging Face model's own keys, which
``GPT2LMHeadModel.load_state_dict(strict=True)`` accepts (a real GPT-2 when ``transformers``
is installed; always a hand-built module tree with GPT-2's names and tied head). A pipeline
starts from a model file (every layout, one process here; the gloo and tensor-parallel cases
are in test_checkpoint_relayout_dist.py); a file that lacks a name, holds another's or
another shape is refused with nothing changed. ``python -m engine export`` writes the file."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from relayout_support import K, N, balance, batch, model, run
from torch import nn
from torch.nn import functional as F

import engine
from engine.errors import CheckpointError
from engine.integrations.hf import next_token_labels, split_causal_lm
from engine.serialization import write_plain

M = 2


def _torch_sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.05, momentum=0.9)


def _pipe(S: int, net: nn.Sequential | None = None, schedule: str = "gpipe") -> engine.Pipeline:
    return engine.Pipeline(net if net is not None else model(), balance=balance(S), schedule=schedule,
                           chunks=M, loss_fn=F.mse_loss, optimizer=_torch_sgd)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_export_equals_the_model_trained_unpipelined(tmp_path: Any, schedule: str) -> None:
    pipe = _pipe(4, schedule=schedule)
    ref = model()
    opt = _torch_sgd(list(ref.parameters()))
    for t in range(N):
        x, y = batch(t)
        pipe.step(x, y)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):  # the pipeline's micro-batches
            (F.mse_loss(ref(xm), ym) * (1.0 / M)).backward()
        opt.step()
    got, want = engine.export(pipe), ref.state_dict()
    assert list(got) == list(want)  # the model's own names, in its order
    assert all(torch.equal(got[k], want[k]) for k in want)
    path = tmp_path / "c.safetensors"
    engine.save(pipe, path)
    from_file = engine.export(path)
    assert from_file.keys() == want.keys() and all(torch.equal(from_file[k], want[k]) for k in want)
    assert not torch.equal(got["0.weight"], model().state_dict()["0.weight"])  # it trained


def test_export_and_model_files_need_names_and_a_flushed_pipeline(tmp_path: Any) -> None:
    whole = model()
    stages = [nn.Sequential(*list(whole)[:4]), nn.Sequential(*list(whole)[4:])]
    pipe = engine.Pipeline(stages, schedule="gpipe", chunks=M, loss_fn=F.mse_loss, optimizer=_torch_sgd)
    with pytest.raises(CheckpointError, match=r"engine.export needs each stage's names .* engine.named_stage"):
        engine.export(pipe)
    path = tmp_path / "model.safetensors"
    write_plain(_trained().state_dict(), path)
    before = _snapshot(pipe)
    with pytest.raises(CheckpointError, match=r"stage\(s\) \[0, 1\] of this pipeline declare none.*named_stage"):
        engine.load(pipe, path)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pipe), strict=True))
    async_pipe = _pipe(2, schedule="pipedream")
    async_pipe.step(*batch(0))
    with pytest.raises(engine.NotFlushedError, match="engine.export"):
        engine.export(async_pipe)


# ------------------------------------------------------------------ starting from a file


def _trained() -> nn.Sequential:
    net = model()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1)
    return net


def _snapshot(p: engine.Pipeline) -> list[torch.Tensor]:
    return [t.detach().clone() for st in p.stages for t in st.module.state_dict().values()]


@pytest.mark.parametrize("S", [1, 3])
def test_a_pipeline_starts_from_a_model_file(tmp_path: Any, S: int) -> None:
    net = _trained()
    path = tmp_path / "model.safetensors"
    write_plain(net.state_dict(), path)
    pipe = _pipe(S)
    engine.load(pipe, path)
    assert engine.export(pipe).keys() == net.state_dict().keys()
    assert all(torch.equal(a, net.state_dict()[k]) for k, a in engine.export(pipe).items())
    direct = _pipe(S, copy.deepcopy(net))  # the same weights given to the pipeline directly
    run(pipe, range(K, N))
    run(direct, range(K, N))
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(pipe), _snapshot(direct), strict=True))


def _refused(path: Any, *needles: str) -> None:
    pipe = _pipe(2)
    run(pipe, range(1))
    before = _snapshot(pipe)
    with pytest.raises(CheckpointError) as info:
        engine.load(pipe, path)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pipe), strict=True))
    for n in needles:
        assert n in str(info.value), (n, str(info.value))


def test_a_model_file_of_another_model_is_refused(tmp_path: Any) -> None:
    sd = _trained().state_dict()
    lacking = tmp_path / "lacking.safetensors"
    write_plain({k: v for k, v in sd.items() if k != "6.bias"}, lacking)
    _refused(lacking, "lacks ['6.bias']", "nothing was loaded")
    extra = tmp_path / "extra.safetensors"
    write_plain({**sd, "9.weight": torch.zeros(2)}, extra)
    _refused(extra, "holds ['9.weight'], which no stage of this pipeline has")
    shaped = tmp_path / "shaped.safetensors"
    write_plain({**sd, "2.weight": torch.zeros(6, 5)}, shaped)
    _refused(shaped, "'2.weight' has shape [6, 5]", "[6, 6]")


# ------------------------------------------------------------------ GPT-2's names


class _Conv1D(nn.Module):  # GPT-2's (in, out) linear: its parameter names and shapes
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = _Conv1D(d, 3 * d), _Conv1D(d, d)
        self.register_buffer("bias", torch.ones(1), persistent=False)  # as GPT-2's: not saved

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(h).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5 + attention_mask[:, 0]
        return self.c_proj(att.softmax(-1) @ v)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = _Conv1D(d, 4 * d), _Conv1D(4 * d, d)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> tuple[torch.Tensor]:
        h = h + self.attn(self.ln_1(h), attention_mask)
        return (h + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(h)))),)


class _GPT2Like(nn.Module):
    """transformer.{wte, wpe, drop, h, ln_f} and a tied lm_head: GPT2LMHeadModel's names."""

    def __init__(self, layers: int = 4, d: int = 8, vocab: int = 16, context: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.transformer.drop = nn.Dropout(0.0)
        self.transformer.h = nn.ModuleList(_Block(d) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def _gpt2() -> nn.Module:
    tf = pytest.importorskip("transformers", reason="transformers is not installed (the hand-built "
                             "tree with GPT-2's names runs instead)")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_embd=8, n_head=2, vocab_size=16, n_positions=8,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg)


def _tokens(t: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask}, next_token_labels(ids, mask)


@pytest.mark.parametrize("make", [_GPT2Like, _gpt2], ids=["gpt2-names", "gpt2-transformers"])
@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_split_causal_lm_exports_the_models_own_keys(tmp_path: Any, make: Any, schedule: str) -> None:
    net = make()
    keys = list(net.state_dict())
    assert "lm_head.weight" in keys and "transformer.h.3.mlp.c_proj.bias" in keys
    pipe = engine.Pipeline(split_causal_lm(net, 3), schedule=schedule, chunks=M, loss_fn=F.cross_entropy,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    for t in range(2):
        pipe.step(*_tokens(t))
    pipe.flush()
    got = engine.export(pipe)
    assert sorted(got) == sorted(keys)
    fresh = make()
    fresh.load_state_dict(got, strict=True)  # what the issue asks: the model takes it as its own
    assert torch.equal(fresh.lm_head.weight, got["transformer.wte.weight"])
    assert not torch.equal(got["transformer.h.0.attn.c_attn.weight"], make().state_dict()[
        "transformer.h.0.attn.c_attn.weight"])
    # save_pretrained drops the tied head: a pipeline of another split starts from that file
    path = tmp_path / "model.safetensors"
    write_plain({k: v for k, v in got.items() if k != "lm_head.weight"}, path)
    other = engine.Pipeline(split_causal_lm(make(), 2), schedule="gpipe", chunks=M, loss_fn=F.cross_entropy,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    engine.load(other, path)
    again = engine.export(other)
    assert all(torch.equal(again[k], got[k]) for k in keys)


def test_the_export_command_writes_the_model_file(tmp_path: Any, capsys: Any) -> None:
    from safetensors.torch import load_file

    from engine.__main__ import main

    pipe = _pipe(4)
    run(pipe, range(K))
    ckpt = tmp_path / "c.safetensors"
    engine.save(pipe, ckpt)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert "wrote 8 tensors" in capsys.readouterr().out
    got = load_file(out)
    want = engine.export(pipe)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert main(["export", str(tmp_path / "missing.safetensors"), "--out", str(out)]) == 1
    assert "cannot read checkpoint" in capsys.readouterr().err
    assert main(["export", str(ckpt)]) == 2  # --out is required
