"""``--optimizer muon`` on the command line: the stage optimizers are engine.optim.Muon with
Moonlight's one-lr recipe, ``train --task lm --schedule 2bw`` runs end to end, and the
options Muon refuses are refused before any work."""

from __future__ import annotations

import math

import pytest

import engine.optim
from engine.__main__ import main
from engine.cli.config import CLIError, TrainConfig, check_config
from engine.cli.loop import build_pipeline
from engine.demo.corpus import ALPHABET


def test_muon_stages_use_one_lr_for_both_parts():
    cfg = TrainConfig(task="lm", schedule="2bw", stages=2, layers=2, width=8, chunks=2,
                      optimizer="muon", lr=0.01, momentum=0.9, ref_batch=None)
    check_config(cfg)
    pipe, _, _ = build_pipeline(cfg, num_features=8, num_classes=5, updates_per_epoch=2)
    assert pipe.delays == [1, 1]
    dims = set()
    for st in pipe.stages:
        opt = st.optimizer
        group = opt.param_groups[0]
        assert isinstance(opt, engine.optim.Muon)
        assert group["adamw_lr"] is None and group["adjust_lr_fn"] == "match_rms_adamw"
        assert group["lr"] == 0.01 and group["momentum"] == 0.9
        dims |= {p.dim() == 2 for p in group["params"]}
    assert dims == {True, False}  # matrices for Muon, layer-norm gains for AdamW


def test_train_task_lm_muon_2bw_runs(tmp_path, capsys):
    code = main([
        "train", "--task", "lm", "--schedule", "2bw", "--stages", "2", "--layers", "2",
        "--width", "16", "--chunks", "2", "--batch-size", "8", "--epochs", "1",
        "--optimizer", "muon", "--lr", "0.03", "--evals-per-epoch", "1", "--no-progress",
        "--out", str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2bw on lm: S=2" in out and "delays=[1, 1]" in out
    loss = float(out.split("test_loss=")[1].split()[0])
    assert loss < 0.9 * math.log(len(ALPHABET))  # below a uniform guess: it learned


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"optimizer": "muon", "spike_compensation": True}, "--spike-compensation does not apply"),
        ({"optimizer": "muon", "schedule": "pb", "prediction": "lwp",
          "prediction_mode": "momentum"}, "--optimizer muon predicts with --prediction-mode linear"),
        ({"optimizer": "muon", "stage_beta1": 0.99}, "--stage-beta1 applies to --optimizer nadam"),
    ],
)
def test_bad_muon_options_are_refused(kw, match):
    with pytest.raises(CLIError, match=match):
        check_config(TrainConfig(**kw))
