"""engine.optim.NAdam inside the pipeline: under PipeDream weight stashing (AsyncPP's setting)
and pb, every micro-batch reads the weight versions ALGORITHMS.md's tables say; the per-stage
beta1 follows the delays the pipeline sets; linear prediction and PipeMare's T2 read the
weights their formulas give, from NAdam's own last_update and delta."""

from __future__ import annotations

import pytest
import torch
from test_runtime_versions import check_step_prediction_or_t2, check_versions, run

from engine import optim
from engine.optim.functional_nadam import nadam_mu, stage_beta1


def _nadam(**fixed):
    def make(params, **kw):
        return optim.NAdam(params, lr=0.01, betas=(0.9, 0.999), weight_decay=0.01,
                           decoupled_weight_decay=True, **fixed, **kw)

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
    check_step_prediction_or_t2(_nadam(), mitigation)
