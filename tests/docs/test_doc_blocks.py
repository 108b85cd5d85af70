"""Every ```python block of README.md and docs/*.md runs as pasted and prints what the text
says (tests/doc_blocks.py: how a block declares that it runs under torchrun, is skipped, or
needs an optional module; a ```text block after it is its output).

Each block runs in a fresh interpreter in an empty folder, as a user who pasted it into a
file would run it: a name the text never defines fails here. Cost: a few seconds per block
(most of it importing torch); the torchrun ones are ``slow``.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import Block, DirectiveError, fences, python_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [b for path in DOCS for b in python_blocks(path)]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def _params() -> list[object]:
    seen: dict[str, int] = {}
    params = []
    for b in BLOCKS:
        name = f"{b.path.name}#{_slug(b.fence.section) or 'top'}"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f"-{seen[name]}"
        marks = []
        if b.run == "torchrun":
            marks += [pytest.mark.slow, pytest.mark.distributed]
        elif b.run == "skip":
            marks.append(pytest.mark.skip(reason=b.reason))
        params.append(pytest.param(b, id=name, marks=marks))
    return params


def run_block(block: Block, folder: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as pasted into ``folder/block.py`` (this checkout's ``engine`` first)."""
    script = folder / "block.py"
    script.write_text(block.code)
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), path) if p))
    if block.run == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={block.ranks}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("block", _params())
def test_block_runs_as_pasted_and_prints_what_the_text_says(block: Block, tmp_path: Path) -> None:
    for module in block.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}, which is not installed (an optional package)")
    proc = run_block(block, tmp_path)
    where = f"{block.path.name}:{block.fence.line}"
    assert proc.returncode == 0, f"{where} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    if block.output is not None:
        checker, flags = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert checker.check_output(block.output, proc.stdout, flags), (
            f"{where} printed\n{proc.stdout}\nwhere the text says it prints\n{block.output}")


def test_the_readme_blocks_are_found_and_say_what_they_print() -> None:
    """The extractor sees every ```python block of the README (a fence it missed would go
    untested) and each one shows its output or asserts it."""
    readme = [b for b in BLOCKS if b.path.name == "README.md"]
    fenced = [f for f in fences(ROOT / "README.md") if f.info == "python"]
    assert len(readme) == len(fenced) >= 6
    assert {b.run for b in readme} >= {"python", "torchrun"}
    silent = [b.fence.line for b in readme if b.output is None and "assert " not in b.code]
    assert silent == []


def test_a_bad_directive_names_its_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# T\n\n<!-- run: torchrun two -->\n```python\nprint(1)\n```\n")
    with pytest.raises(DirectiveError, match=r"page.md:4: unknown run directive 'torchrun two'"):
        python_blocks(page)
    page.write_text("<!-- run: skip (needs a GPU); needs cupy -->\n```python\nx\n```\n\n```text\n1\n```\n")
    (block,) = python_blocks(page)
    assert (block.run, block.reason, block.needs, block.output) == ("skip", "needs a GPU", ("cupy",), "1\n")
