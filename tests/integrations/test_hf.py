"""engine.integrations.hf: a Hugging Face causal LM split into stages trains through the pipeline exactly
as the unsplit model does with the same micro-batches (GPT-2 with tied embeddings and padding
masks; Llama with rotary positions). Models are built from configs: no downloads.

Needs ``transformers`` (not a dependency of the project); without it those tests skip."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import engine
from engine.integrations.hf import next_token_labels, split_causal_lm

M = 2  # micro-batches per step


def _transformers():
    return pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )


def _gpt2(impl: str = "eager") -> nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = impl
    return tf.GPT2LMHeadModel(cfg)


def _llama() -> nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=3, vocab_size=64,
                         max_position_embeddings=16, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return tf.LlamaForCausalLM(cfg)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding in both micro-batches
    mask[3, 5:] = 0
    return ids, mask


def _hf_step(model: nn.Module, opt: torch.optim.Optimizer, ids, mask) -> None:
    """The unsplit model on the same M micro-batches: mean of their losses, one step."""
    opt.zero_grad(set_to_none=True)
    labels = next_token_labels(ids, mask)
    for i, m, y in zip(ids.chunk(M), mask.chunk(M), labels.chunk(M), strict=True):
        logits = model(input_ids=i, attention_mask=m).logits
        (F.cross_entropy(logits.transpose(1, 2), y) / M).backward()
    opt.step()


@pytest.mark.parametrize(
    "make, split",
    [
        (lambda: _gpt2("eager"), dict(stages=3)),
        (lambda: _gpt2("sdpa"), dict(balance=[0, 2, 2, 0])),
        (_llama, dict(stages=3)),
    ],
    ids=["gpt2-eager", "gpt2-sdpa-own-stages", "llama"],
)
def test_split_forward_equals_the_model(make, split) -> None:
    model = make()
    ids, mask = _batch(0)
    ref = model(input_ids=ids, attention_mask=mask).logits.transpose(1, 2)
    h = {"input_ids": ids, "attention_mask": mask}
    stages = split_causal_lm(model, **split)
    for s in stages[:-1]:
        h = s(**h)
        assert set(h) == {"hidden_states", "attention_mask"}
    torch.testing.assert_close(stages[-1](**h), ref, rtol=0, atol=0)


@pytest.mark.slow  # a few seconds each once transformers is imported
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipelined_gpt2_trains_as_the_unpipelined_model(schedule: str) -> None:
    model = _gpt2()
    ref = copy.deepcopy(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    pipe = engine.Pipeline(
        split_causal_lm(model, 3), schedule=schedule, chunks=M, loss_fn=F.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    )
    assert len(pipe.ties) == 1  # wte and lm_head: one weight, two stages
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        ids, mask = _batch(step)
        loss = pipe.step({"input_ids": ids, "attention_mask": mask}, next_token_labels(ids, mask))
        assert torch.isfinite(torch.as_tensor(loss))
        _hf_step(ref, ref_opt, ids, mask)
    pipe.flush()
    _same_weights(model, ref)
    # the head holds its own copy of the tied weight, kept bitwise equal to the embedding
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    assert not torch.equal(model.transformer.wte.weight, _gpt2().transformer.wte.weight)


def _same_weights(model: nn.Module, ref: nn.Module) -> None:
    """The stages hold the model's own modules: ``model`` is the trained model."""
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for name, a in mine.items():
        torch.testing.assert_close(a, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # a few seconds each once transformers is imported
def test_llama_trains_through_the_pipeline_as_unsplit() -> None:
    model = _llama()
    ref = copy.deepcopy(model)
    pipe = engine.Pipeline(
        split_causal_lm(model, balance=[1, 1, 1]), schedule="1f1b", chunks=M,
        loss_fn=F.cross_entropy, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        ids, mask = _batch(step)
        pipe.step({"input_ids": ids, "attention_mask": mask}, next_token_labels(ids, mask))
        _hf_step(ref, ref_opt, ids, mask)
    _same_weights(model, ref)


# ------------------------------------------------------------------ without transformers


def test_next_token_labels_shift_and_ignore_padding() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert next_token_labels(ids, mask).tolist() == [[6, 7, 8, -100], [2, -100, -100, -100]]
    assert next_token_labels(ids).tolist() == [[6, 7, 8, -100], [2, 0, 0, -100]]


def test_unsupported_models_and_bad_splits_say_what_is_wrong() -> None:
    with pytest.raises(TypeError, match="Linear is not a supported causal LM.*GPT-2 style"):
        split_causal_lm(nn.Linear(2, 2), 2)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(8, 4), nn.Embedding(8, 4)
            self.h = nn.ModuleList(nn.Identity() for _ in range(3))
            self.ln_f = nn.LayerNorm(4)

    class Fake(nn.Module):
        def __init__(self, head: bool = True):
            super().__init__()
            self.transformer = Body()
            if head:
                self.lm_head = nn.Linear(4, 8, bias=False)

    with pytest.raises(TypeError, match="has no lm_head"):
        split_causal_lm(Fake(head=False), 2)
    with pytest.raises(ValueError, match="stages=4 but the model has 3 blocks"):
        split_causal_lm(Fake(), 4)
    with pytest.raises(ValueError, match=r"balance=\[1, 1\] sums to 2, but the model has 3"):
        split_causal_lm(Fake(), balance=[1, 1])
    assert [len(s.blocks) for s in split_causal_lm(Fake(), 2)] == [2, 1]
    assert [len(s.blocks) for s in split_causal_lm(Fake(), balance=[0, 3, 0])] == [0, 3, 0]


@pytest.mark.slow  # a few seconds each once transformers is imported
def test_readme_example_runs_and_tie_weights_reties() -> None:
    _transformers()
    from test_readme import _blocks

    (snippet,) = [b for b in _blocks("python") if "split_causal_lm" in b]
    scope: dict = {}
    torch.manual_seed(0)
    exec(compile(snippet, "README.md", "exec"), scope)
    model = scope["model"]
    assert torch.isfinite(torch.as_tensor(scope["loss"]))
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    model.tie_weights()  # what the README says to do before save_pretrained
    assert model.lm_head.weight is model.transformer.wte.weight
