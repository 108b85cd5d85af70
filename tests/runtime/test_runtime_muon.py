"""engine.optim.Muon inside the pipeline: under PipeDream-2BW (Zmushko et al.'s setting),
PipeDream weight stashing and pb, every micro-batch reads the weight versions ALGORITHMS.md's
tables say, each stage's flat bucket is stepped in one call with Muon on its matrices and
AdamW on the rest, and linear prediction and PipeMare's T2 read the weights their formulas
give, from Muon's own last_update and delta."""

from __future__ import annotations

import pytest
import torch
from schedules import STASHED
from test_runtime_versions import check_step_prediction_or_t2, check_versions, run

from engine import optim


def _muon(calls: list | None = None):
    def make(params, **kw):
        opt = optim.Muon(params, lr=0.02, weight_decay=0.01, adamw_lr=0.01, **kw)
        if calls is not None:  # numel of every update call
            original = opt._call_update
            opt._call_update = lambda fn, group, param, *rest: (
                calls.append(param.numel()), original(fn, group, param, *rest))
        return opt

    return make


@pytest.mark.parametrize("schedule", STASHED)
def test_muon_reads_the_scheduled_versions_and_trains(schedule):
    S = M = 3
    calls: list[int] = []
    pipe, got, hist, N = run(S, M, schedule, _muon(calls=calls))
    check_versions(pipe, got, hist, N, schedule)
    assert [st.optimizer.param_groups[0]["delay"] for st in pipe.stages] == pipe.delays
    if schedule == "2bw":
        assert pipe.delays == [1, 1, 1]  # the one-step delay Zmushko et al. study
    updates = sum(len(h) - 1 for h in hist.w)
    assert len(calls) == updates  # one flat update per stage step, not one per tensor
    for s, st in enumerate(pipe.stages):
        opt = st.optimizer
        for p in opt.param_groups[0]["params"]:
            state = opt.state[p]
            if p.dim() == 2:  # a Linear weight: Muon's state only
                assert set(state) == {"momentum_buffer"}, (s, set(state))
                assert state["momentum_buffer"].abs().sum() > 0
            else:  # the probe, biases: AdamW's, with one step per update
                assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, (s, set(state))
                assert int(state["step"]) == len(hist.w[s]) - 1
        assert not torch.equal(hist.w[s][0], hist.w[s][-1]), f"stage {s} never moved"


@pytest.mark.parametrize("mitigation", ["prediction", "t2"])
def test_muon_linear_prediction_and_t2_under_pb(mitigation):
    check_step_prediction_or_t2(_muon(), mitigation)
