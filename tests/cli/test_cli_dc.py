"""``--delay-compensation`` on the command line: the stage optimizers get DC-ASGD's lambda,
``compare`` runs it in its ``*+dc`` methods only, bad settings are refused before any work."""

from __future__ import annotations

import argparse

import pytest

from engine.cli import compare, train
from engine.cli.config import CLIError, TrainConfig, check_config, config_from_args
from engine.cli.loop import build_pipeline


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "nadam"])
def test_flag_reaches_every_stage_optimizer(optimizer: str) -> None:
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--schedule", "pipedream", "--stages", "4", "--layers", "4", "--width",
                         "8", "--chunks", "4", "--optimizer", optimizer,
                         "--delay-compensation", "0.5"])
    cfg = config_from_args(args)
    check_config(cfg)
    pipe, _, _ = build_pipeline(cfg, num_features=8, num_classes=3, updates_per_epoch=2)
    assert pipe.delays == [3, 2, 1, 0]
    for st in pipe.stages:
        assert st.optimizer.param_groups[0]["delay_compensation"] == 0.5
    assert cfg.label() == "pipedream+DC0.5"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"schedule": "pipedream", "delay_compensation": -1.0}, "must be a finite number >= 0"),
        ({"schedule": "2bw", "delay_compensation": float("nan")}, "must be a finite number >= 0"),
        ({"schedule": "gpipe", "delay_compensation": 0.1}, "--schedule gpipe has no delay"),
        ({"schedule": "pb", "delay_compensation": 0.1}, "needs --discrepancy-correction"),
        ({"schedule": "2bw", "optimizer": "muon", "delay_compensation": 0.1}, "Muon has no delay compensation"),
        ({"schedule": "2bw", "optimizer": "basis-rotation", "delay_compensation": 0.1},
         "--delay-compensation does not apply to --optimizer basis-rotation"),
    ],
)
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(CLIError, match=match):
        check_config(TrainConfig(**kw))


def test_compare_gives_lambda_to_the_dc_methods_only() -> None:
    base = TrainConfig(task="lm")
    for lam, want in ((0.0, compare.DC_LAMBDA), (0.3, 0.3)):
        cfg = TrainConfig(task="lm", delay_compensation=lam)
        got = {name: compare.method_config(cfg, m, 4, None, 1)
               for name, m in compare.METHODS.items()}
        for name, c in got.items():
            assert c.delay_compensation == (want if name.endswith("+dc") else 0.0), name
            check_config(c)  # every method is a valid run
        assert got["pipemare-t2+dc"].discrepancy_correction
        assert (got["pipedream+dc"].schedule, got["2bw+dc"].schedule) == ("pipedream", "2bw")
    assert compare.method_config(base, compare.METHODS["pb"], 4, None, 1).delay_compensation == 0.0


def test_all_is_the_papers_methods_and_dc_runs_by_name() -> None:
    """The main job (`compare`, methods 'all') keeps the papers' twelve methods; the project's
    own DC combinations run when named."""
    from engine.cli.compare import _parse_methods

    names = [m.name for m in _parse_methods("all")]
    assert len(names) == 12 and not any("+dc" in n for n in names)
    assert [m.name for m in _parse_methods("pb,2bw+dc")] == ["pb", "2bw+dc"]
