"""``--optimizer nadam`` and ``--stage-beta1`` on the command line: the stage optimizers are
engine.optim.NAdam with AsyncPP's NAdamW settings and per-stage beta1; bad combinations are
refused before any work."""

from __future__ import annotations

import pytest

import engine.optim
from engine.cli.config import CLIError, TrainConfig, check_config
from engine.cli.loop import build_pipeline
from engine.optim.functional_nadam import stage_beta1


def test_nadam_stages_get_the_per_stage_beta1():
    cfg = TrainConfig(schedule="pipedream", stages=4, layers=4, width=8, chunks=4,
                      optimizer="nadam", momentum=0.9, ref_batch=None, stage_beta1=0.99)
    check_config(cfg)
    pipe, _, _ = build_pipeline(cfg, num_features=8, num_classes=3, updates_per_epoch=2)
    assert pipe.delays == [3, 2, 1, 0]
    for s, st in enumerate(pipe.stages):
        opt = st.optimizer
        group = opt.param_groups[0]
        assert isinstance(opt, engine.optim.NAdam) and group["decoupled_weight_decay"]
        assert opt._beta1(group) == stage_beta1(0.9, 0.99, 4, pipe.delays[s])
    assert cfg.label() == "pipedream+b1s0.99"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"optimizer": "nadam", "spike_compensation": True}, "--spike-compensation does not apply"),
        ({"optimizer": "nadam", "schedule": "pb", "prediction": "lwp",
          "prediction_mode": "momentum"}, "--prediction-mode linear only"),
        ({"optimizer": "adam", "stage_beta1": 0.99}, "--stage-beta1 applies to --optimizer nadam"),
        ({"optimizer": "nadam", "stage_beta1": 0.99}, r"beta1 = 0.99"),  # 0.9 scaled to B=1
        ({"optimizer": "nadam", "stage_beta1": 1.0, "ref_batch": None}, r"\[beta1, 1\)"),
    ],
)
def test_bad_nadam_options_are_refused(kw, match):
    with pytest.raises(CLIError, match=match):
        check_config(TrainConfig(**kw))
