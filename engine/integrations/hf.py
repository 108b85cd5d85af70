"""Split a Hugging Face causal language model into pipeline stages.

Why this module: an HF model is not an ``nn.Sequential``. Its decoder blocks take the
attention mask (and, for rotary models, the position embeddings) as *keyword* arguments, in
an order that differs between families (``GPT2Block(hidden_states, past_key_values,
cache_position, attention_mask, ...)``), the mask the blocks want is a 4-D additive one the
model builds internally, and the output head shares its weight with the token embedding.
Passing ``(h, mask)`` from stage to stage as a tuple would put the mask into the wrong
argument. :func:`split_causal_lm` returns stages that do the wiring:

* every stage but the last returns ``{"hidden_states": h, "attention_mask": m}`` (a dict:
  the next stage is called with keywords), where ``m`` is the (batch, time) padding mask
  (1 = token, 0 = padding) -- small to send between processes; each stage builds the 4-D
  causal-and-padding mask its blocks take from it;
* stage 0 holds the embeddings (token, plus position for GPT-2) and takes ``input_ids`` and
  an optional ``attention_mask``;
* the last stage holds the final norm and ``lm_head`` and returns logits as (batch, vocab,
  time), so ``torch.nn.functional.cross_entropy(logits, labels)`` is the loss (labels -100
  are ignored: :func:`next_token_labels` makes them);
* the model's own modules are used, not copies, so a tied ``lm_head.weight`` is the
  embedding's ``Parameter`` and ``engine.Pipeline`` keeps the two tied (on every schedule;
  see the README on ties);
* each stage declares its tensors' names in the model (``blocks.2`` of stage 1 is
  ``transformer.h.4``; :mod:`engine.model_names`), so a checkpoint loads into another split
  and ``engine.export`` gives the model's own ``state_dict`` keys.

Supported layouts (duck-typed, transformers is not imported here): GPT-2 style
(``model.transformer.{wte, wpe, drop, h, ln_f}``, e.g. ``GPT2LMHeadModel``) and Llama style
(``model.model.{embed_tokens, layers, norm, rotary_emb}``: Llama, Mistral, Qwen2, ...).
Training uses no KV cache; dropout draws differ from an unpipelined run only in order.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["split_causal_lm", "next_token_labels", "CausalLMStage"]


def _layout(model: nn.Module) -> dict[str, Any]:
    """The embedding, blocks, final norm and head of a supported HF causal LM."""
    head = getattr(model, "lm_head", None)
    body = getattr(model, "transformer", None)
    if body is not None and all(hasattr(body, a) for a in ("wte", "wpe", "h", "ln_f")):
        return dict(tok=body.wte, pos=body.wpe, drop=getattr(body, "drop", None),
                    blocks=list(body.h), norm=body.ln_f, rotary=None, head=head)
    body = getattr(model, "model", None)
    if body is not None and all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm")):
        return dict(tok=body.embed_tokens, pos=None, drop=None, blocks=list(body.layers),
                    norm=body.norm, rotary=getattr(body, "rotary_emb", None), head=head)
    raise TypeError(
        f"split_causal_lm: {type(model).__name__} is not a supported causal LM; expected a "
        "GPT-2 style model (model.transformer.wte/wpe/h/ln_f and model.lm_head) or a Llama "
        "style one (model.model.embed_tokens/layers/norm and model.lm_head)"
    )


def _padding_mask(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
            f"{tuple(input_ids.shape)}: give one (batch, time) mask, 1 for tokens, 0 for padding"
        )
    return attention_mask


def _block_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(batch, 1, time, time) additive mask: 0 where query t may attend key u (u <= t and u
    not padding), the dtype's minimum elsewhere (HF's convention for a 4-D mask)."""
    T = mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    keep = causal[None, None] & mask.bool()[:, None, None, :]
    out = torch.zeros(keep.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~keep, torch.finfo(dtype).min)


class CausalLMStage(nn.Module):
    """A run of decoder blocks, with the embeddings in front (stage 0) and/or the final norm
    and head behind (the last stage); see the module docstring for what flows between."""

    def __init__(self, parts: dict[str, Any], blocks: Sequence[nn.Module], *, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.tok = parts["tok"] if first else None
        self.pos = parts["pos"] if first else None
        self.drop = parts["drop"] if first else None
        self.blocks = nn.ModuleList(blocks)
        # rotary position embeddings have no parameters (a buffer of frequencies): each
        # stage with blocks gets its own copy (a module runs in one stage) and computes them
        self.rotary = copy.deepcopy(parts["rotary"]) if blocks and parts["rotary"] is not None else None
        self.norm = parts["norm"] if last else None
        self.head = parts["head"] if last else None

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                hidden_states: Tensor | None = None) -> Any:
        if self.first:
            if input_ids is None:
                raise ValueError("stage 0 of a causal LM takes input_ids (and attention_mask)")
            attention_mask = _padding_mask(input_ids, attention_mask)
            h = self.tok(input_ids)
            if self.pos is not None:
                h = h + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
            if self.drop is not None:
                h = self.drop(h)
        else:
            if hidden_states is None or attention_mask is None:
                raise ValueError("a later stage of a causal LM takes hidden_states and "
                                 "attention_mask (the previous stage's output dict)")
            h = hidden_states
        if self.blocks:
            extra: dict[str, Any] = {"attention_mask": _block_mask(attention_mask, h.dtype)}
            if self.rotary is not None:
                positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
                extra["position_ids"] = positions
                extra["position_embeddings"] = self.rotary(h, positions)
            for block in self.blocks:
                out = block(h, **extra)
                h = out[0] if isinstance(out, tuple) else out
        if self.last:
            return self.head(self.norm(h)).transpose(1, 2)  # (batch, vocab, time)
        return {"hidden_states": h, "attention_mask": attention_mask}


def split_causal_lm(model: nn.Module, stages: int | None = None, *,
                    balance: Sequence[int] | None = None) -> list[nn.Module]:
    """``model``'s stages for ``engine.Pipeline``: ``stages`` of about equal numbers of
    decoder blocks, or ``balance``, the blocks per stage (0 allowed: e.g. ``[0, 4, 4, 0]``
    puts the embeddings and the head on stages of their own).

    The stages hold the model's modules (no copies): train the stages, and ``model`` is the
    trained model. Feed ``pipe.step({"input_ids": ids, "attention_mask": mask}, labels)``
    with ``loss_fn=torch.nn.functional.cross_entropy`` and ``labels =
    next_token_labels(ids, mask)``.
    """
    parts = _layout(model)
    if parts["head"] is None:
        raise TypeError(f"split_causal_lm: {type(model).__name__} has no lm_head; pass the "
                        "*ForCausalLM / *LMHeadModel, not the bare decoder")
    n = len(parts["blocks"])
    if balance is None:
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"split_causal_lm: stages={stages!r} must be an int >= 1 "
                             "(or pass balance=[blocks per stage])")
        if stages > max(n, 1):
            raise ValueError(f"split_causal_lm: stages={stages} but the model has {n} blocks; "
                             "use at most that many stages, or balance= with zeros")
        q, r = divmod(n, stages)
        balance = [q + (1 if s < r else 0) for s in range(stages)]
    else:
        balance = list(balance)
        if stages is not None and stages != len(balance):
            raise ValueError(f"split_causal_lm: stages={stages} but balance has {len(balance)} entries")
        if not balance or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in balance):
            raise ValueError(f"split_causal_lm: balance={balance} must be blocks per stage, ints >= 0")
        if sum(balance) != n:
            raise ValueError(f"split_causal_lm: balance={balance} sums to {sum(balance)}, but the "
                             f"model has {n} blocks")
    from engine.model_names import declare

    where: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        where.setdefault(id(m), name)
    out: list[nn.Module] = []
    i = 0
    for s, k in enumerate(balance):
        stage = CausalLMStage(parts, parts["blocks"][i : i + k], first=s == 0,
                              last=s == len(balance) - 1)
        # the stage's tensors by the model's names (transformer.h.5.attn..., lm_head.weight):
        # a checkpoint moves between splits and exports to the model's state_dict
        names = {f"blocks.{j}": where[id(b)] for j, b in enumerate(stage.blocks)}
        for attr in ("tok", "pos", "norm", "head"):
            sub = getattr(stage, attr)
            if sub is not None:
                names[attr] = where[id(sub)]
        if stage.rotary is not None:  # (a copy per stage: the model's own rotary_emb)
            names["rotary"] = where[id(parts["rotary"])]
        out.append(declare(stage, names))
        i += k
    return out


def next_token_labels(input_ids: Tensor, attention_mask: Tensor | None = None,
                      ignore_index: int = -100) -> Tensor:
    """Labels for next-token prediction, aligned with ``input_ids``: position t's label is
    token t+1; the last position and padding get ``ignore_index`` (cross_entropy skips them).
    HF's ``model(input_ids, labels=input_ids)`` shifts inside its loss; this is that shift."""
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:]
    if attention_mask is not None:
        keep = _padding_mask(input_ids, attention_mask).bool()
        labels[:, :-1] = labels[:, :-1].masked_fill(~keep[:, 1:], ignore_index)
    return labels
