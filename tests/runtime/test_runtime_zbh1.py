"""ZB-H1 in the runtime: B computes only the input gradient, W the weight gradient, each when
the schedule says (transparency and gloo equality live in test_runtime_sync.py,
test_runtime_versions.py, test_runtime_trees.py and the gloo configs)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from engine import Pipeline
from engine.errors import PipelineConfigError
from engine.schedule import Action, Kind, analyze, generate, parse
from engine.schedule.lower import add_comms


def _stages(S: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(S - 1)]
    return out + [nn.Linear(4, 2)]


def _pipe(stages: list[nn.Module], schedule: object, **kw: object) -> Pipeline:
    return Pipeline(stages, schedule=schedule, loss_fn=nn.functional.mse_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw)


def test_weight_gradients_accumulate_only_at_w() -> None:
    """Before each W on a stage, the stage's gradients hold exactly the Ws run so far, although
    every B before it already ran (and sent its input gradient upstream)."""
    S, M = 3, 4
    stages = _stages(S)
    pipe = _pipe(stages, "zbh1", chunks=M)
    seen: list[tuple[int, str, int, float]] = []

    def hook(s: int, kind: str, n: int) -> None:
        grads = [p.grad for p in stages[s].parameters() if p.grad is not None]
        seen.append((s, kind, n, float(sum(g.abs().sum() for g in grads))))

    pipe.parts.executor.action_hook = hook
    pipe.step(torch.randn(2 * M, 4), torch.randn(2 * M, 2))
    for s in range(S):
        mine = [(k, n, g) for st, k, n, g in seen if st == s]
        ws = [g for k, _, g in mine if k == "W"]
        assert len(ws) == M and ws[0] == 0.0 and all(g > 0 for g in ws[1:]), (s, mine)
        # the first W comes after s + 1 backwards (stage s defers its Ws by s)
        first_w = [k for k, _, _ in mine].index("W")
        assert [k for k, _, _ in mine[:first_w]].count("B") == s + 1
    # a deferred W keeps its micro-batch's activations: 1f1b's stage-0 peak on every stage
    stats = pipe.stats()
    assert stats["activation_peak"] == [min(M, S)] * S
    # the engine's clock replays what ran with the analysis' unit costs (F = B = W = 1)
    assert stats["bubble_fraction"] == pytest.approx(analyze(generate("zbh1", S, M)).bubble_fraction)
    assert pipe.parts.executor.in_flight() == 0


def test_hand_written_program_equals_built_in_bitwise() -> None:
    text = (
        "schedule myzb stages=2 chunks=2 steps=1 update_size=2 order=zb-h1 weights=live ticks=0\n"
        "s0: F0 F1 B0 W0 B1 W1 U0-1\n"
        "s1: F0 B0 F1 B1 W0 W1 U0-1\n"
    )
    assert add_comms(parse(text)).actions == generate("zbh1", 2, 2).actions
    a, b = _stages(2), _stages(2)
    built_in, program = _pipe(a, "zbh1", chunks=2), _pipe(b, text)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        assert torch.equal(built_in.step(x, y), program.step(x, y))
    for p, q in zip([p for m in a for p in m.parameters()],
                    [q for m in b for q in m.parameters()], strict=True):
        assert torch.equal(p, q)


def test_partly_split_synchronous_program_equals_whole_backwards() -> None:
    """Stage 1 splits its backwards, stage 0 runs them whole (DualPipeV mixes both on one
    stage): the same training as whole backwards everywhere."""
    head = "schedule half stages=2 chunks=2 steps=1 update_size=2 order=x weights=live ticks=0\n"
    split = head + "s0: F0 F1 B0 B1 U0-1\ns1: F0 B0 F1 B1 W0 W1 U0-1\n"
    whole = head + "s0: F0 F1 B0 B1 U0-1\ns1: F0 B0 F1 B1 U0-1\n"
    a, b = _stages(2), _stages(2)
    pa, pb = _pipe(a, split), _pipe(b, whole)
    assert pa.parts.executor.spec.split_only == (frozenset(), frozenset({0, 1}))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        assert torch.equal(pa.step(x, y), pb.step(x, y))
    for p, q in zip([p for m in a for p in m.parameters()], [p for m in b for p in m.parameters()], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_partly_split_asynchronous_program_is_refused() -> None:
    base = generate("pb", stages=2, chunks=2, steps=2, order="1f1b")
    s1 = tuple(x for a in base.actions[1]
               for x in ((a, Action.weight(a.mb)) if a.kind is Kind.BACKWARD else (a,)))
    program = dataclasses.replace(base, name="pbw", actions=(base.actions[0], s1), ticks=None)
    stages = _stages(2)
    before = copy.deepcopy([p.detach() for m in stages for p in m.parameters()])
    with pytest.raises(PipelineConfigError, match=r"splits the backwards of only some"):
        _pipe(stages, program)
    assert all(torch.equal(p, q) for p, q in
               zip(before, [p.detach() for m in stages for p in m.parameters()], strict=True))


def test_asynchronous_program_with_w_equals_whole_backwards() -> None:
    """An asynchronous program (pb in 1f1b order, live weights) with a W right after every B
    trains exactly as with whole backwards: the split runs per stage, outside batched calls."""
    base = generate("pb", stages=2, chunks=2, steps=2, order="1f1b")
    actions = tuple(
        tuple(x for a in acts for x in ((a, Action.weight(a.mb)) if a.kind is Kind.BACKWARD else (a,)))
        for acts in base.actions
    )
    program = dataclasses.replace(base, name="pbw", actions=actions, ticks=None)
    a, b = _stages(2), _stages(2)
    whole, split = _pipe(a, "pb", chunks=2, order="1f1b"), _pipe(b, program)
    assert split.parts.executor.spec.split_backward and not split.parts.executor.spec.synchronous
    at_w: list[float] = []  # k = 1: a stage's gradients are empty when each W starts

    def hook(s: int, kind: str, n: int) -> None:
        if kind == "W":
            # as they count: a GPU stage's buffer is stale, not zeroed, after an update
            at_w.append(float(sum(f.abs().sum() for f in split.stages[s].store.grad_state())))

    split.parts.executor.action_hook = hook
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
        assert torch.equal(whole.step(x, y), split.step(x, y))
    whole.flush()
    split.flush()
    assert len(at_w) == 2 * 4 and set(at_w) == {0.0}
    for p, q in zip([p for m in a for p in m.parameters()],
                    [q for m in b for q in m.parameters()], strict=True):
        assert torch.equal(p, q)
