"""The language-model task (engine/demo/models.py ``gpt``, engine/demo/corpus.py, ``--task lm``): the
corpus is the same bytes everywhere, the model is causal and its pipelined forward equals
the whole model's, the synchronous schedules train the tied GPT as the unpipelined model
does, and ``train --task lm`` runs end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine
from engine.__main__ import main
from engine.demo.corpus import ALPHABET, CORPUS_BYTES, corpus_sha256, encode, generate_corpus
from engine.demo.data import LM_CONTEXT, load_lm_dataset
from engine.demo.models import ModelError, gpt, split_layers
from engine.schedule.catalog import SCHEDULES, SYNCHRONOUS

VOCAB, T, M = len(ALPHABET), 16, 2


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y)


def test_corpus_is_the_same_bytes_on_every_machine() -> None:
    text = generate_corpus()
    assert len(text) == CORPUS_BYTES == 30_000
    assert corpus_sha256() == "188fa9c9fe5db4d34107d04361ab71100a5cd357e05a0c2272aac3d39958bd91"
    assert set(text.decode()) <= set(ALPHABET)
    assert generate_corpus(64, seed=1) != generate_corpus(64, seed=2)
    with pytest.raises(ValueError, match="byte 35 is not in the corpus alphabet"):
        encode(b"a#")


def test_lm_dataset_is_shifted_windows_split_by_position() -> None:
    d = load_lm_dataset()
    assert d.train_x.shape[1] == LM_CONTEXT and d.num_classes == VOCAB
    assert torch.equal(d.train_x[:, 1:], d.train_y[:, :-1])  # y is x shifted by one character
    ids = torch.tensor(encode(generate_corpus()))
    assert torch.equal(d.train_x[1], ids[LM_CONTEXT + 1 : 2 * LM_CONTEXT + 1])
    last = (len(d.train_x) + len(d.test_x) - 1) * (LM_CONTEXT + 1)  # the test set is the tail
    assert torch.equal(d.test_x[-1], ids[last : last + LM_CONTEXT])


def test_gpt_is_causal_and_its_stages_chain_to_the_whole_model() -> None:
    torch.manual_seed(0)
    model = gpt(VOCAB, T, layers=5, width=16, heads=2)
    x = torch.randint(0, VOCAB, (3, T))
    whole = model(x)
    assert whole.shape == (3, VOCAB, T)
    h = x
    stages = split_layers(model, [2, 2, 1])
    for s in stages:
        h = s(*h) if isinstance(h, tuple) else s(h)
        if s is not stages[-1]:
            assert isinstance(h, tuple) and h[1].dtype == torch.bool  # the mask travels on
    assert torch.equal(h, whole)
    future = x.clone()
    future[:, 10:] = (future[:, 10:] + 1) % VOCAB  # change only positions >= 10
    out = model(future)
    assert torch.equal(out[..., :10], whole[..., :10]) and not torch.equal(out, whole)
    assert model[-1].weight is model[0].tok.weight  # tied head
    untied = gpt(VOCAB, T, layers=3, width=16, tie=False)
    assert untied[-1].weight is not untied[0].tok.weight
    assert torch.equal(untied[-1].weight, untied[0].tok.weight)
    with pytest.raises(ModelError, match="multiple of the 3 attention heads"):
        gpt(VOCAB, T, layers=3, width=16, heads=3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved"])
def test_sync_schedules_train_the_tied_gpt_as_the_unpipelined_model(schedule: str) -> None:
    torch.manual_seed(1)
    model = gpt(VOCAB, T, layers=4, width=16, heads=2)
    ref = gpt(VOCAB, T, layers=4, width=16, heads=2)
    ref.load_state_dict(model.state_dict())
    assert ref[-1].weight is ref[0].tok.weight

    def opt(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        # SGD: Adam would divide the key bias's ~0 gradient (softmax ignores it) by its own
        # rounding noise, turning float reassociation into lr-sized differences
        return engine.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)

    # interleaved: 4 virtual stages on 2 ranks (rank 0 runs the embedding and block 2)
    split, extra = ([1, 1, 1, 1], {"virtual_stages": 2}) if schedule == "interleaved" else ([1, 2, 1], {})
    stages = split_layers(model, split)
    pipe = engine.Pipeline(stages, schedule=schedule, chunks=M, loss_fn=_loss, optimizer=opt, **extra)
    assert pipe.ties and pipe.ties[0].stages == [0, len(split) - 1]
    ref_opt = opt(list(ref.parameters()))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g)
        loss = pipe.step(x, y)
        ref_opt.zero_grad()
        ref_loss = sum(_loss(ref(xc), yc) / M for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True))
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6)
    head, embed = pipe.stages[-1].module[-1].weight, pipe.stages[0].module[0].tok.weight
    assert head is not embed and torch.equal(head, embed)  # two copies, bitwise equal
    want = dict(ref.named_parameters(remove_duplicate=False))  # "3.weight" is the tied head
    for name, a in ((n, p) for st in pipe.stages for n, p in st.module.named_parameters()):
        b = want.pop(name)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not want


@pytest.mark.parametrize("schedule", ["1f1b", "pb"])
def test_train_task_lm_runs(tmp_path, capsys, schedule: str) -> None:
    code = main([
        "train", "--task", "lm", "--schedule", schedule, "--stages", "2", "--layers", "3",
        "--width", "16", "--chunks", "2", "--batch-size", "16", "--epochs", "1",
        "--optimizer", "adamw", "--lr", "0.03", "--evals-per-epoch", "1", "--no-progress",
        "--out", str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{schedule} on lm: S=2" in out
    assert (tmp_path / "checkpoint.safetensors").stat().st_size > 0
    acc = float(out.split("test_acc=")[1].split()[0])
    assert acc > 1.5 / VOCAB  # learned something beyond a uniform guess


def test_task_lm_refuses_a_dataset(capsys) -> None:
    code = main(["train", "--task", "lm", "--dataset", "wine", "--no-progress"])
    assert code == 2
    assert "--dataset wine applies to --task classify" in capsys.readouterr().err


def test_task_defaults_leave_the_digits_job_unchanged() -> None:
    import argparse

    from engine.cli import compare, train
    from engine.cli.config import config_from_args

    for add in (train.add_arguments, compare.add_arguments):
        p = argparse.ArgumentParser()
        add(p)
        digits = config_from_args(p.parse_args([]))
        assert (digits.task, digits.layers, digits.width, digits.lr) == ("classify", 16, 64, 0.03)
        lm = config_from_args(p.parse_args(["--task", "lm", "--width", "48"]))
        assert (lm.layers, lm.width, lm.lr) == (4, 48, 0.3)  # the command line wins
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    assert config_from_args(p.parse_args([])).stages == 8
    assert config_from_args(p.parse_args(["--task", "lm"])).stages == 4
    assert config_from_args(p.parse_args(["--no-scaling"])).ref_batch is None


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_train_ties_the_gpt_head_on_every_schedule(schedule: str) -> None:
    """``train --task lm`` ties the head to the embedding on every family: synchronous ones
    keep equal copies (zbh1 included: it once built an untied head from a hand-written
    list), asynchronous ones carry the embedding's value to the head (tie_carry.py)."""
    import argparse

    from engine.cli import train
    from engine.cli.config import config_from_args
    from engine.cli.loop import build_pipeline

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    chunks = "2" if schedule != "2bw" else "4"
    cfg = config_from_args(p.parse_args([
        "--task", "lm", "--schedule", schedule, "--stages", "2", "--layers", "2",
        "--width", "16", "--chunks", chunks,
    ]))
    pipe, modules, _ = build_pipeline(cfg, T, VOCAB, updates_per_epoch=1)
    assert pipe.ties and pipe.ties[0].stages == [0, 1]
    assert pipe.ties[0].carried == (schedule not in SYNCHRONOUS)
    if schedule not in SYNCHRONOUS:  # the head reads the carried value: no parameter of its own
        assert "weight" not in dict(modules[-1][-1].named_parameters(recurse=False))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g)
    assert torch.isfinite(pipe.step(x, y))
