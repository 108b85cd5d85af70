"""A static check: random draws in GPU test files use a generator on the device they fill.

Why static: torch refuses to fill a CUDA tensor from a CPU ``torch.Generator`` ("Expected a
'cuda' device type for generator but found 'cpu'"), but only on a machine with a GPU. On
the H100, 38 tests of tests/optim/test_optim_multi.py never ran for that reason (issue 22): under
tests/kernel_support.py's autouse fixture, ``torch.randn(n, generator=cpu_gen)`` with no
``device=`` draws on the CUDA default device. CPU CI can see the pattern in the source.

The rules, for a call that passes ``generator=``:

* a factory (``torch.randn(..., generator=g)``) names its ``device=`` where the file runs its
  tests under a default-device context (kernel_support's ``_on_device`` fixture), since
  there the default is the GPU;
* an explicit ``device=`` must be the generator's device (``torch.Generator()`` is "cpu");
* an in-place fill (``t.normal_(generator=g)``) with a CPU generator is refused under a
  default-device context, where ``t`` was made on the GPU, unless ``t`` itself is made right
  there with an explicit matching ``device=``.

A generator's device is read from its ``torch.Generator(...)`` call: inline, or from the
assignments to the name it is passed as; for a name with no assignment in the file (a
helper's parameter), from the file's generators when they all agree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

FILL_METHODS = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_",
                "cauchy_", "log_normal_"}
CPU = "cpu"


def _norm(expr: ast.expr | None) -> str | None:
    """Canonical device text: 'cpu' for every spelling of the CPU, else the source."""
    if expr is None:
        return None
    text = ast.unparse(expr).replace('"', "'")
    m = re.fullmatch(r"(?:torch\.device\()?'(\w+)(?::\d+)?'\)?", text)
    return m.group(1) if m else text


def _generator_call(expr: ast.AST) -> ast.Call | None:
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.Generator", "Generator"):
            return node
    return None


def _generator_device(call: ast.Call) -> str:
    if call.args:
        return _norm(call.args[0]) or CPU
    for kw in call.keywords:
        if kw.arg == "device":
            return _norm(kw.value) or CPU
    return CPU


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def uses_default_device(source: str) -> bool:
    """Whether the file's tests run under a default-device context (kernel_support)."""
    return bool(re.search(r"\b_on_device\b|set_default_device\(|with torch\.device\(", source))


def check_source(source: str, *, default_device: bool, filename: str = "<source>") -> list[str]:
    """Every draw that would fill tensors of another device than its generator's."""
    tree = ast.parse(source, filename)
    assigned: dict[str, set[str]] = {}
    every: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.Generator", "Generator"):
            every.add(_generator_device(node))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            gen = _generator_call(node.value)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if gen is not None and isinstance(t, ast.Name):
                    assigned.setdefault(t.id, set()).add(_generator_device(gen))
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        gexpr = _keyword(node, "generator")
        if gexpr is None or (isinstance(gexpr, ast.Constant) and gexpr.value is None):
            continue
        inline = _generator_call(gexpr)
        if inline is not None:
            gdev: str | None = _generator_device(inline)
        elif isinstance(gexpr, ast.Name) and len(assigned.get(gexpr.id, ())) == 1:
            (gdev,) = assigned[gexpr.id]
        elif isinstance(gexpr, ast.Name) and gexpr.id not in assigned and len(every) == 1:
            (gdev,) = every
        else:
            gdev = None
        where = f"{filename}:{node.lineno}: {ast.unparse(node)[:90]}"
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in FILL_METHODS:
            recv = func.value
            recv_dev = _norm(_keyword(recv, "device")) if isinstance(recv, ast.Call) else None
            if recv_dev is not None and gdev is not None and recv_dev != gdev:
                problems.append(f"{where}: fills a {recv_dev} tensor from a {gdev} generator")
            elif recv_dev is None and default_device and gdev in (CPU, None):
                problems.append(f"{where}: fills a tensor made under the test's default device "
                                f"(the GPU there) from a {gdev or 'unknown-device'} generator; draw "
                                "on the generator's device and .to() the tensor's")
            continue
        dev = _norm(_keyword(node, "device"))
        if dev is None:
            if default_device:
                problems.append(f"{where}: names no device=, so under the test's default device "
                                f"(the GPU there) it draws from a {gdev or 'unknown-device'} "
                                "generator; pass the generator's device and .to() the target")
            elif gdev not in (None, CPU):
                problems.append(f"{where}: draws on the CPU (no device=) from a {gdev} generator")
        elif gdev is not None and dev != gdev:
            problems.append(f"{where}: draws on {dev} from a {gdev} generator")
    return problems


def check_file(path: Path) -> list[str]:
    source = path.read_text()
    return check_source(source, default_device=uses_default_device(source), filename=path.name)
