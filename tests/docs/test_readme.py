"""README's examples mean what they say, beyond running (tests/docs/test_doc_blocks.py runs every
Python block as pasted): the hand-written schedule text is accepted and equals the built-in
family it claims to equal, and the transformer keeps its tie and equals the unpipelined model."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from doc_blocks import fences

import engine

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    """The fenced blocks whose info string is ``lang`` ("" for a bare fence)."""
    return [f.body for f in fences(README) if f.info == lang]


def test_readme_starts_with_the_two_commands() -> None:
    bash = _blocks("bash")[0].strip().splitlines()
    assert len(bash) == 2
    assert "python3 -m engine compare" in bash[0]
    assert "python3 -m pytest" in bash[1]


def test_handwritten_schedule_equals_builtin() -> None:
    (program,) = [b for b in _blocks("") if b.startswith("schedule ")]
    family = re.search(r"order=(\w+)", program).group(1)

    def run(schedule: object) -> list[torch.Tensor]:
        torch.manual_seed(1)
        stages = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)]
        pipe = engine.Pipeline(
            stages, schedule=schedule, chunks=2, loss_fn=torch.nn.functional.cross_entropy,
            optimizer=lambda p: engine.optim.SGD(p, lr=0.1, momentum=0.9),
        )
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            pipe.step(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
        pipe.flush()
        return [p.detach().clone() for s in stages for p in s.parameters()]

    for a, b in zip(run(program), run(family), strict=True):
        assert torch.equal(a, b)


def test_transformer_snippet_keeps_the_tie_and_equals_the_unpipelined_model(capsys) -> None:
    (snippet,) = [b for b in _blocks("python") if "engine.Pipeline(" in b and "Embedding" in b]
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    pipe = scope["pipe"]
    assert torch.isfinite(scope["loss"])
    assert "holders=[(0, 'tok.weight'), (3, 'weight')]" in capsys.readouterr().out
    assert pipe.ties and pipe.ties[0].stages == [0, 3]
    embed, head = pipe.stages[0].module.tok.weight, pipe.stages[3].module.weight
    assert embed is not head and torch.equal(embed, head)  # one update, two equal copies
    x = scope["tokens"][:, :-1]
    h = x
    for st in pipe.stages:  # the unpipelined model: the same modules, called in sequence
        st.module.eval()
        h = st.module(*h) if isinstance(h, tuple) else st.module(h)
    with torch.no_grad():
        torch.testing.assert_close(pipe.evaluate(x, chunks=1), h, rtol=1e-5, atol=1e-5)


def test_transformer_snippet_under_zbh1_equals_1f1b_bit_for_bit() -> None:
    """The README lists zbh1 among the schedules that keep ties: the split backward sums the
    tied gradients the same way, so its weights equal 1f1b's bit for bit."""
    (snippet,) = [b for b in _blocks("python") if "engine.Pipeline(" in b and "Embedding" in b]
    weights = {}
    for schedule in ("1f1b", "zbh1"):
        torch.manual_seed(0)
        scope: dict = {}
        code = snippet.replace('schedule="1f1b"', f'schedule="{schedule}"').replace("print(", "(")
        exec(compile(code, "README.md", "exec"), scope)
        pipe, tokens = scope["pipe"], scope["tokens"]
        pipe.step(tokens[:, :-1], tokens[:, 1:])
        assert pipe.ties and pipe.spec.name == schedule
        weights[schedule] = [p.detach().clone() for st in pipe.stages for p in st.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights["1f1b"], weights["zbh1"], strict=True))
