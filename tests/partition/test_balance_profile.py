"""balance="time" that cuts at the same layers every time: the median of a chosen number of
timed runs per layer, and a saved profile (JSON) that reruns and every rank reuse."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import engine
from engine.errors import PipelineConfigError
from engine.partition import load_profile, profile_layers, save_profile


def _seq(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)], nn.Linear(width, 4 * width),
                         nn.Linear(4 * width, width), *[nn.Linear(width, width) for _ in range(2)])


def _pipe(seq: nn.Sequential, profile, repeats: int = 3) -> engine.Pipeline:
    return engine.Pipeline(
        seq, schedule="1f1b", chunks=2, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), balance="time", num_stages=3,
        sample=torch.randn(4, seq[0].in_features), balance_repeats=repeats, balance_profile=profile,
    )


def test_a_saved_profile_fixes_the_split(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "layers.json"
    first = _pipe(_seq(), path, repeats=5)
    data = json.loads(path.read_text())
    assert data["repeats"] == 5 and len(data["layers"]) == 8
    # a rerun must not measure again: make any measurement fail loudly
    import engine.partition.balance as balance_mod

    def no_profiling(*a, **k):
        raise AssertionError("profiled again although a saved profile exists")

    monkeypatch.setattr(balance_mod, "profile_layers", no_profiling)
    second = _pipe(_seq(), path)
    assert second.balance == first.balance


def test_the_split_follows_the_saved_costs(tmp_path) -> None:
    """The saved numbers are what the solver uses: make the last layer by far the slowest
    and it gets a stage of its own."""
    seq = _seq()
    costs = profile_layers(seq, torch.randn(4, 32), repeats=1)
    slow = [c.__class__(**{**c.__dict__, "forward_time": 1.0 if k == 7 else 1e-3,
                           "backward_time": 0.0}) for k, c in enumerate(costs)]
    save_profile(slow, seq, tmp_path / "p.json", repeats=1, device="cpu")
    assert _pipe(_seq(), tmp_path / "p.json").balance[-1] == 1


def test_a_profile_of_another_model_is_refused(tmp_path) -> None:
    seq = _seq()
    save_profile(profile_layers(seq, torch.randn(4, 32), repeats=1), seq, tmp_path / "p.json",
                 repeats=1, device="cpu")
    with pytest.raises(ValueError, match="measured on another model.*layer 0 differs"):
        load_profile(_seq(width=16), tmp_path / "p.json")
    with pytest.raises(PipelineConfigError, match="measured on another model"):
        _pipe(_seq(width=16), tmp_path / "p.json")
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(PipelineConfigError, match="is not a layer profile"):
        _pipe(_seq(), tmp_path / "bad.json")


def test_balance_repeats_must_be_positive(tmp_path) -> None:
    with pytest.raises(PipelineConfigError, match="repeats"):
        _pipe(_seq(), None, repeats=0)
