"""engine._C must use the process's one C++ runtime: which libstdc++ a build links, and a
compiler that links it shared.

Why: a module that carries its own copy of libstdc++ (linked in statically) shares
``std::`` objects -- strings, streams, locales -- with torch's libraries, which use the
shared one; the two copies' locale state differ, and the first error message engine._C
formatted through an ``std::ostringstream`` (``c10::str``) crashed the process (SIGSEGV).
Toolchains exist that link libstdc++ statically even when told ``-lstdc++`` (no
``libstdc++.so.6`` among the module's NEEDED entries; docs/design-notes.md, "A second C++
runtime"). So setup.py probes the compiler before building and picks one that links
it shared (:func:`pick_compilers`), checks the module it built (:func:`links_shared`), and
CMakeLists.txt runs this file on its output; ``python -m engine info`` reports it. Only the
standard library here: setup.py loads this file by path, before engine is installed.

    python engine/tooling/cxx_runtime.py PATH/_C*.so   # exit 1, with the fix, if libstdc++ is static
    python engine/tooling/cxx_runtime.py --pick        # which compiler a build here uses, and why
"""

from __future__ import annotations

import os
import shlex
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["compiler_links_shared", "links_shared", "needed_libraries", "pick_compilers",
           "static_problem"]

_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5
_PT_LOAD, _PT_DYNAMIC = 1, 2


def needed_libraries(path: str | Path) -> list[str]:
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF file, in order. Raises
    ``ValueError`` naming the file for anything else (not ELF, 32-bit, big-endian, no
    dynamic section)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise ValueError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: only 64-bit little-endian ELF files are read")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == _PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise ValueError(f"{path}: no dynamic section (a static executable?)")
    needed: list[int] = []
    strtab_addr = None
    off, size = dynamic
    for pos in range(off, off + size, 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_NEEDED:
            needed.append(value)
        elif tag == _DT_STRTAB:
            strtab_addr = value
    if strtab_addr is None:
        raise ValueError(f"{path}: its dynamic section has no string table")
    for vaddr, offset, filesz in loads:  # the table's address -> its place in the file
        if vaddr <= strtab_addr < vaddr + filesz:
            strtab = offset + strtab_addr - vaddr
            break
    else:
        raise ValueError(f"{path}: its string table lies outside every loaded segment")
    out = []
    for name in needed:
        end = data.index(b"\0", strtab + name)
        out.append(data[strtab + name:end].decode())
    return out


def links_shared(path: str | Path) -> bool:
    """Whether the ELF file at ``path`` names libstdc++ among its NEEDED libraries."""
    return any(n.startswith("libstdc++.so") for n in needed_libraries(path))


_PROBE = ('#include <sstream>\n#include <string>\n'
          'std::string pe_probe(long v) { std::ostringstream s; s << v; return s.str(); }\n')


def compiler_links_shared(cxx: str) -> bool | None:
    """Whether the C++ compiler command ``cxx`` (it may carry flags) links a shared object
    against the shared libstdc++: it builds a one-function library and reads its NEEDED
    entries. None when the probe cannot tell (the compiler failed or is missing)."""
    argv = shlex.split(cxx)
    if not argv or shutil.which(argv[0]) is None:
        return None
    with tempfile.TemporaryDirectory(prefix="pe-cxx-probe-") as tmp:
        src, lib = Path(tmp) / "probe.cpp", Path(tmp) / "libprobe.so"
        src.write_text(_PROBE)
        try:
            r = subprocess.run([*argv, "-shared", "-fPIC", str(src), "-o", str(lib)],
                               capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0 or not lib.exists():
            return None
        try:
            return links_shared(lib)
        except ValueError:
            return None


def _c_compiler_beside(cxx: str) -> str | None:
    """The C compiler of the same toolchain as ``cxx`` (g++ -> gcc, c++ -> cc, clang++ ->
    clang), when it exists."""
    for tail, c in (("clang++", "clang"), ("g++", "gcc"), ("c++", "cc")):
        if cxx.endswith(tail):
            cand = cxx[: -len(tail)] + c
            return cand if shutil.which(cand) else None
    return None


def pick_compilers(environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], str]:
    """The ``CXX``/``CC`` settings a build should use so that engine._C links libstdc++
    shared, and a note saying why: ``({}, "")`` when the compiler the build would use
    already does (or cannot be probed: then the post-build check decides). When it links
    libstdc++ statically, the first C++ compiler that links it shared among Python's
    configured one, ``/usr/bin/g++``, ``g++`` and ``c++`` on the PATH; raises
    ``RuntimeError`` with the fix when there is none."""
    current = environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    if compiler_links_shared(current) is not False:
        return {}, ""
    seen = {os.path.realpath(shutil.which(shlex.split(current)[0]) or current)}
    for cand in (sysconfig.get_config_var("CXX"), "/usr/bin/g++", "g++", "c++"):
        if not cand:
            continue
        exe = shutil.which(shlex.split(cand)[0])
        if exe is None or os.path.realpath(exe) in seen:
            continue
        seen.add(os.path.realpath(exe))
        if compiler_links_shared(exe):
            cc = _c_compiler_beside(exe)
            env = {"CXX": exe, **({"CC": cc} if cc else {})}
            return env, (f"{current} links libstdc++ statically, which crashes engine._C "
                         f"(engine/tooling/cxx_runtime.py); building with {exe} instead")
    raise RuntimeError(
        f"the C++ compiler {current!r} links libstdc++ statically, and no other compiler found "
        "here links it shared; engine._C built so would crash the process on its first error "
        "message (engine/tooling/cxx_runtime.py). Set CXX (and CC) to a compiler whose libstdc++ is "
        "shared -- the one torch was built with, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc")


def static_problem(path: str | Path) -> str:
    """What is wrong with a module at ``path`` that names no libstdc++, and the fix: one
    message for the build's check, CMake's post-build step and ``python -m engine info``."""
    return (f"{path}: libstdc++ is linked in statically (no libstdc++.so among its NEEDED "
            "libraries), so the process holds two C++ runtimes and this module crashes it on "
            "its first error message (engine/tooling/cxx_runtime.py). Rebuild with a compiler whose "
            "libstdc++ is shared: CXX=/usr/bin/g++ CC=/usr/bin/gcc")


def describe_pick(environ: Mapping[str, str] = os.environ) -> str:
    """What :func:`pick_compilers` decides here, in words: the configured compiler, whether
    it links libstdc++ shared, and the compiler a build will use (raises as it does)."""
    current = environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    env, note = pick_compilers(environ)
    if env:
        return f"compiler switch: {note} (CXX={env['CXX']}" + (
            f", CC={env['CC']})" if "CC" in env else ")")
    verdict = {True: "links libstdc++ shared", None: "could not be probed (the post-build "
               "check decides)"}[compiler_links_shared(current)]
    return f"no compiler switch: {current} {verdict}; the build uses it"


def main(argv: list[str]) -> int:
    """``python engine/tooling/cxx_runtime.py FILE...``: 1 (with the fix) if a file is static;
    ``--pick``: :func:`describe_pick` (1, with the fix, when no compiler here will do)."""
    if argv == ["--pick"]:
        try:
            print(describe_pick())
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    bad = [p for p in argv if not links_shared(p)]
    for p in bad:
        print(static_problem(p), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
