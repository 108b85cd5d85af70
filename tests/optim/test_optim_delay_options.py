"""The delay keywords are one options object (engine.mitigations.DelayOptions) shared by the
five engine optimizers: the same keyword names and defaults in every constructor's signature,
the same group entries, and one check that refuses a bad value with the same message."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from engine import optim
from engine.mitigations import MITIGATION_OPTIONS, DelayOptions

FIVE = [optim.SGD, optim.Adam, optim.AdamW, optim.NAdam, optim.Muon]
#: keywords an optimizer does not take (Muon: delay compensation, docs/ALGORITHMS.md)
LACKS = {optim.Muon: {"delay_compensation"}}
NAMES = [f.name for f in dataclasses.fields(DelayOptions)]


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3, 3))]


@pytest.mark.parametrize("opt", FIVE, ids=lambda c: c.__name__)
def test_every_optimizer_takes_the_delay_keywords_with_their_defaults(opt: type) -> None:
    sig = inspect.signature(opt).parameters
    taken = [n for n in NAMES if n not in LACKS.get(opt, set())]
    assert {n: sig[n].default for n in taken} == {n: getattr(DelayOptions(), n) for n in taken}
    assert all(sig[n].kind is inspect.Parameter.KEYWORD_ONLY for n in taken)
    assert not set(sig) & (LACKS.get(opt, set()) | {"delay_options"})
    given = dict(delay=3, prediction="linear", prediction_horizon=2.0, correction_decay=0.3,
                 discrepancy_correction=True)
    extra = dict(momentum=0.9) if opt is optim.SGD else {}  # (SGD predicts along momentum)
    group = opt(_params(), lr=0.01, **extra, **given).param_groups[0]
    assert {k: group[k] for k in given} == given
    with pytest.raises(TypeError, match="unexpected keyword argument 'delay_compensations'"):
        opt(_params(), lr=0.01, delay_compensations=0.1)


def test_muon_takes_no_delay_compensation() -> None:
    with pytest.raises(TypeError, match="delay_compensation"):
        optim.Muon(_params(), lr=0.01, delay_compensation=0.1)
    assert "delay_compensation" not in optim.Muon(_params(), lr=0.01).param_groups[0]


@pytest.mark.parametrize("opt", FIVE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad,message", [
    (dict(delay=-1), "delay=-1 is invalid"),
    (dict(delay=1.5), "delay=1.5 is invalid"),
    (dict(prediction="cubic"), "prediction='cubic' is not a prediction mode"),
    (dict(prediction_horizon=-2.0), "prediction_horizon=-2.0 is invalid"),
    (dict(correction_decay=1.5), "correction_decay=1.5 is invalid"),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_a_bad_delay_option_is_refused_by_the_one_check(opt: type, bad: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        opt(_params(), lr=0.01, **bad)


def test_the_mitigations_are_delay_options() -> None:
    assert set(MITIGATION_OPTIONS) <= set(NAMES)
