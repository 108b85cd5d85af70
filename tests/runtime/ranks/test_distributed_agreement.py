"""Ranks started with different settings fail fast, all of them, naming the setting
(engine/runtime/ranks/agreement.py), instead of deadlocking until the timeout."""

from __future__ import annotations

import pytest
from distributed_support import spawn

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("key,named", [
    ("chunks", "chunks: rank 0 has 4, rank 1 has 2"),
    ("schedule", "schedule: rank 0 has '1f1b', rank 1 has 'gpipe'"),
    ("prediction", "optimizer mitigations: rank 0 has {"),
])
def test_a_rank_with_other_settings_fails_fast_everywhere(key: str, named: str) -> None:
    results = spawn(3, [("disagree", dict(S=3, key=key))], timeout=120)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        r = res["disagree"]
        assert r["error"] is not None and "PipelineConfigError" in r["error"], (rank, r)
        assert f"the ranks disagree on {named}" in r["error"], (rank, r["error"])
        if key == "prediction":
            assert "'prediction': 'linear'" in r["error"]
        assert r["seconds"] < 25, "it waited for the timeout instead of failing fast"


def test_a_stage_without_parameters_agrees_and_matches_local() -> None:
    """Its rank has no optimizer settings to compare: the others' still agree."""
    results = spawn(3, [("parameterless", dict(S=3))], timeout=120)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        r = res["parameterless"]
        assert "error" not in r, r.get("error")
        assert r["equal"], rank


def test_fingerprint_covers_every_delay_option_of_the_optimizer() -> None:
    """What the ranks compare (without processes): each mitigation the stage optimizer was
    built with, so a rank started with another one fails at construction."""
    from types import SimpleNamespace

    from torch import nn

    import engine
    from engine.runtime.ranks.agreement import fingerprint

    spec = SimpleNamespace(name="pipedream", stages=2, chunks=2, update_size=1, order="1f1b")
    cfg = SimpleNamespace(transport="gloo", data_parallel=1, checkpoint="never", on_nonfinite="raise")
    lin = nn.Linear(2, 2)

    def mitigations(**kw: object) -> dict:
        opt = engine.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, **kw)
        return dict(fingerprint(spec, cfg, {}, [], opt, lin)["pipeline"])["optimizer mitigations"]

    off = {"spike_compensation": False, "discrepancy_correction": False, "delay_compensation": 0.0}
    assert mitigations() == off
    assert mitigations(delay_compensation=0.5) == {**off, "delay_compensation": 0.5}
    assert mitigations(spike_compensation=True, prediction="linear") == {
        **off, "spike_compensation": True, "prediction": "linear"}
