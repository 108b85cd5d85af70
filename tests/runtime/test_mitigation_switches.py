"""One switch per mitigation (docs/DESIGN.md, "One switch per mitigation"): the pipeline's
``weight_prediction`` and ``discrepancy_correction`` choose which weights F and B read, and
the pipeline asks the stage optimizer for what that needs. The old spelling -- an engine
optimizer built with ``prediction=`` or ``discrepancy_correction=True`` and no pipeline
option -- still switches the mitigation on, warns (DeprecationWarning) naming the new
spelling and the release that removes the old one, and gives the same run bit for bit."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import engine
import engine._deprecation
from engine import optim

S, M, STEPS = 3, 3, 4

#: (optimizer keywords, pipeline keywords) of the old spelling, then of the new one, and
#: the new spelling the warning must name
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], str]] = {
    "lwp": (dict(prediction="linear"), {}, {}, dict(weight_prediction="lwp"),
            "Pipeline(weight_prediction='lwp')"),
    # the optimizer's prediction option keeps choosing the form (how to predict)
    "lwp-momentum-form": (dict(prediction="momentum"), {}, dict(prediction="momentum"),
                          dict(weight_prediction="lwp"), "Pipeline(weight_prediction='lwp')"),
    "t2": (dict(discrepancy_correction=True, correction_decay=0.2), {}, {},
           dict(discrepancy_correction=True, correction_decay=0.2),
           "Pipeline(discrepancy_correction=True)"),
}


def _run(opt_kw: dict[str, Any], pipe_kw: dict[str, Any], family: type = optim.SGD) -> Any:
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(S)]
    extra = dict(momentum=0.9) if family is optim.SGD else {}
    pipe = engine.Pipeline(
        stages, schedule="pb", chunks=M, loss_fn=nn.functional.mse_loss,
        optimizer=lambda p: family(p, lr=0.05, **extra, **opt_kw), **pipe_kw)
    g = torch.Generator().manual_seed(1)
    losses = [pipe.step(torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g))
              for _ in range(STEPS)]
    pipe.flush()
    return pipe, losses


def _tensors(pipe: Any) -> list[torch.Tensor]:
    out = []
    for st in pipe.stages:
        out += [p.detach() for p in st.module.parameters()]
        out += [v for s in st.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("family", [optim.SGD, optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_old_spelling_warns_and_runs_bit_for_bit_as_the_new_one(case: str, family: type) -> None:
    old_opt, old_pipe, new_opt, new_pipe, named = CASES[case]
    with pytest.warns(DeprecationWarning) as caught:
        old, old_losses = _run(old_opt, old_pipe, family)
    texts = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(named in t and f"removed in {engine._deprecation.REMOVED_IN}" in t for t in texts), texts
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling warns nothing
        new, new_losses = _run(new_opt, new_pipe, family)
    assert (old.weight_prediction, old.discrepancy_correction) == (
        new.weight_prediction, new.discrepancy_correction)
    assert old.weight_prediction is not None or old.discrepancy_correction
    assert all(torch.equal(a, b) for a, b in zip(old_losses, new_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(old), _tensors(new), strict=True))
    assert [st.optimizer.param_groups[0] | {"params": None} for st in old.stages] == [
        st.optimizer.param_groups[0] | {"params": None} for st in new.stages]


def test_an_option_the_pipeline_sets_is_checked_by_the_optimizer_at_build() -> None:
    # SGD without momentum cannot predict: refused while the pipeline is built, naming the
    # stage and the option, as the optimizer's constructor would
    with pytest.raises(engine.PipelineConfigError, match=r"stage 0: .*prediction='linear' needs momentum"):
        engine.Pipeline([nn.Linear(4, 4) for _ in range(2)], schedule="pb", chunks=2,
                        loss_fn=nn.functional.mse_loss, weight_prediction="lwp",
                        optimizer=lambda p: optim.SGD(p, lr=0.1))
