"""engine.optim.NAdam inside the pipeline: under PipeDream weight stashing (AsyncPP's setting)
and pb, every micro-batch reads the weight versions ALGORITHMS.md's tables say; the per-stage
beta1 follows the delays the pipeline sets; linear prediction and PipeMare's T2 read the
weights their formulas give, from NAdam's own last_update and delta."""

from __future__ import annotations

import pytest
import torch
from test_runtime_versions import check_versions, run

from engine import optim
from engine.optim.functional_nadam import nadam_mu, stage_beta1


def _nadam(record: list | None = None, **kw):
    def make(params):
        opt = optim.NAdam(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.01,
                          decoupled_weight_decay=True, **kw)
        if record is not None:  # last_update of the probe weight, one entry per version
            p0, s = params[0], len(record)
            record.append([None])
            opt.register_step_post_hook(
                lambda o, *a: record[s].append(o.state[p0]["last_update"].clone()))
        return opt

    return make


@pytest.mark.parametrize("schedule", ["pipedream", "pb"])
@pytest.mark.parametrize("S,M", [(2, 2), (4, 4)])
def test_nadam_reads_the_scheduled_versions_and_trains(schedule, S, M):
    pipe, got, hist, N = run(S, M, schedule, _nadam(stage_beta1=(0.99, 2 * S)))
    check_versions(pipe, got, hist, N, schedule)
    assert [st.optimizer.param_groups[0]["delay"] for st in pipe.stages] == pipe.delays
    for s, st in enumerate(pipe.stages):
        group = st.optimizer.param_groups[0]
        assert st.optimizer._beta1(group) == stage_beta1(0.9, 0.99, 2 * S, pipe.delays[s])
        assert not torch.equal(hist.w[s][0], hist.w[s][-1]), f"stage {s} never moved"
        # the stage's flat bucket: one step and one mu_product shared by its params, advanced
        # by one flat update per optimizer step
        state = [st.optimizer.state[p] for p in group["params"]]
        assert all(x["mu_product"] is state[0]["mu_product"] for x in state)
        prod = torch.ones(())
        for t in range(1, int(state[0]["step"]) + 1):
            prod *= nadam_mu(st.optimizer._beta1(group), 4e-3, t)
        assert torch.equal(state[0]["mu_product"], prod)


@pytest.mark.parametrize("mitigation", ["prediction", "t2"])
def test_nadam_linear_prediction_and_t2_under_pb(mitigation):
    S, M = 3, 3
    record: list = []
    kw = {"prediction": "linear"} if mitigation == "prediction" else {"discrepancy_correction": True}
    pipe, got, hist, N = run(S, M, "pb", _nadam(record if mitigation == "prediction" else None, **kw))
    D = pipe.delays

    def f_value(s, t):  # LWP from NAdam's applied step: w_t - D_s * (w_{t-1} - w_t)
        last = record[s][t]
        return hist.w[s][t] if last is None or D[s] == 0 else hist.w[s][t] - D[s] * last

    def b_value(s, t, wf):  # PipeMare T2: w_t - D_s * delta_t
        d = hist.delta[s][t]
        return hist.w[s][t] if d is None else hist.w[s][t] - D[s] * d

    if mitigation == "prediction":
        assert pipe.weight_prediction == "lwp"
        check_versions(pipe, got, hist, N, "pb", f_value=f_value)
    else:
        assert pipe.discrepancy_correction
        check_versions(pipe, got, hist, N, "pb", b_value=b_value)
