"""The fenced code blocks of the project's markdown, and how each ```python block runs.

Why: README examples drifted from the code they show (a ``Sequential(...)``, an undefined
``loss``, a torchrun example that trained nothing) because nothing ran them.
tests/docs/test_doc_blocks.py runs every ```python block of README.md and docs/*.md as pasted.

How a block runs is said by an HTML comment on the last non-blank line above its fence (it
does not render: say the same in the text beside the block):

    <!-- run: python -->                 the default: ``python block.py`` in an empty folder
    <!-- run: torchrun N -->             ``torchrun --standalone --nproc-per-node N block.py``
    <!-- run: skip (REASON) -->          never run here; the test is skipped with REASON
    <!-- run: python; needs MODULE -->   skipped when MODULE cannot be imported

What a block prints: a ```text block right after it (blank lines between at most) is its
expected standard output, compared as doctest compares (``...`` matches anything, runs of
whitespace are equal). A block may also assert what its text says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Fence", "Block", "fences", "python_blocks", "DirectiveError"]

_DIRECTIVE = re.compile(r"^<!--\s*run:\s*(?P<text>.*?)\s*-->$")
_HEADING = re.compile(r"^#+\s+(?P<title>.+?)\s*$")


class DirectiveError(ValueError):
    """A ``<!-- run: ... -->`` comment this module does not understand."""


@dataclass(frozen=True)
class Fence:
    """One fenced block: the 1-based line of its opening fence, its info string, its body."""

    line: int
    end: int  # the line of its closing fence
    info: str
    body: str
    section: str  # the heading above it ("" before the first)
    directive: str | None  # the text of a ``<!-- run: ... -->`` right above it


@dataclass(frozen=True)
class Block:
    """A ```python block and how it runs (module docstring)."""

    path: Path
    fence: Fence
    run: str  # "python", "torchrun" or "skip"
    ranks: int = 1
    reason: str = ""
    needs: tuple[str, ...] = ()
    output: str | None = None  # the ```text block after it: what it prints

    @property
    def code(self) -> str:
        return self.fence.body


def fences(path: Path) -> list[Fence]:
    """Every fenced block of the markdown file ``path``, in order."""
    lines = path.read_text().splitlines()
    out: list[Fence] = []
    section, opened, info, body = "", None, "", []
    for i, line in enumerate(lines):
        if opened is None:
            heading = _HEADING.match(line)
            if heading:
                section = heading["title"]
            elif line.startswith("```"):
                opened, info, body = i, line[3:].strip(), []
        elif line.startswith("```"):
            above = next((lines[j].strip() for j in range(opened - 1, -1, -1) if lines[j].strip()), "")
            directive = _DIRECTIVE.match(above)
            out.append(Fence(opened + 1, i + 1, info, "\n".join(body) + "\n", section,
                             directive["text"] if directive else None))
            opened = None
        else:
            body.append(line)
    return out


def _parse(path: Path, fence: Fence) -> dict[str, object]:
    text = fence.directive or "python"
    where = f"{path.name}:{fence.line}"
    first, *extras = [part.strip() for part in text.split(";")]
    how: dict[str, object] = {}
    if first == "python":
        how["run"] = "python"
    elif m := re.fullmatch(r"torchrun (\d+)", first):
        how.update(run="torchrun", ranks=int(m[1]))
    elif m := re.fullmatch(r"skip \((.+)\)", first):
        how.update(run="skip", reason=m[1])
    else:
        raise DirectiveError(
            f"{where}: unknown run directive {text!r}; write 'python', 'torchrun N' or "
            "'skip (REASON)', optionally followed by '; needs MODULE'"
        )
    needs = []
    for extra in extras:
        m = re.fullmatch(r"needs ([\w.]+(?:\s*,\s*[\w.]+)*)", extra)
        if not m:
            raise DirectiveError(f"{where}: unknown run option {extra!r} in {text!r}; write 'needs MODULE'")
        needs += [n.strip() for n in m[1].split(",")]
    how["needs"] = tuple(needs)
    return how


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of ``path`` with how each runs and what it prints."""
    all_fences = fences(path)
    lines = path.read_text().splitlines()
    out = []
    for k, fence in enumerate(all_fences):
        if fence.info != "python":
            if fence.directive is not None:
                raise DirectiveError(f"{path.name}:{fence.line}: a run directive above a "
                                     f"```{fence.info} block; only ```python blocks run")
            continue
        nxt = all_fences[k + 1] if k + 1 < len(all_fences) else None
        between = lines[fence.end : nxt.line - 1] if nxt is not None else []
        output = None
        if nxt is not None and nxt.info == "text" and not any(s.strip() for s in between):
            output = nxt.body
        out.append(Block(path, fence, output=output, **_parse(path, fence)))  # type: ignore[arg-type]
    return out
