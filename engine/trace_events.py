"""Chrome/Perfetto trace-event documents: the one writer of the engine's traces.

Why one module: the schedule's modelled timeline (:func:`engine.schedule.render.chrome_trace`)
and a pipeline's recorded one (``with pipe.trace(path):``, engine/runtime/stage/trace.py) are
meant to open side by side in ui.perfetto.dev or chrome://tracing: the same complete events
(``"ph": "X"``, one thread per stage), the same metadata events naming processes and threads,
the same document. Written once here, the two cannot drift apart; :func:`validate` checks a
document against what the viewers need.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["complete", "document", "metadata", "validate", "write"]

Event = dict[str, Any]


def complete(name: str, cat: str, ts: float, dur: float, pid: int, tid: int,
             args: dict[str, Any]) -> Event:
    """A complete event: ``name`` ran from ``ts`` for ``dur`` microseconds on thread ``tid``
    of process ``pid``."""
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def metadata(kind: str, pid: int, tid: int = 0, **args: Any) -> Event:
    """A metadata event: ``process_name``/``thread_name`` (``name=``), ``thread_sort_index``
    (``sort_index=``)."""
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def document(events: list[Event], other: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object form of a trace (``other``: what it shows, as ``otherData``)."""
    doc: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if other is not None:
        doc["otherData"] = other
    return doc


def write(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


_PHASES = set("BEXiIbneCMsftPNODRc")


def validate(doc: Any) -> list[str]:
    """Problems of ``doc`` against the Trace Event Format (the JSON object form); [] if none.
    Checks what Perfetto and chrome://tracing need to load it: a ``traceEvents`` list of
    objects with a known ``ph``, integer ``pid``/``tid``, numeric ``ts`` (and ``dur`` >= 0
    for complete events), string names, and ``args`` objects."""
    problems: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["the document is not an object with a 'traceEvents' list"]
    for k, e in enumerate(doc["traceEvents"]):
        where = f"event {k}"
        if not isinstance(e, dict):
            problems.append(f"{where} is not an object")
            continue
        ph = e.get("ph")
        if ph not in _PHASES:
            problems.append(f"{where}: unknown ph {ph!r}")
        if not isinstance(e.get("name"), str):
            problems.append(f"{where}: name is not a string")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int):
                problems.append(f"{where}: {key} is not an integer")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args is not an object")
        if ph == "M":
            if e.get("name") in ("process_name", "thread_name") and not isinstance(
                e.get("args", {}).get("name"), str
            ):
                problems.append(f"{where}: metadata without args.name")
            continue
        if not isinstance(e.get("ts"), (int, float)):
            problems.append(f"{where}: ts is not a number")
        if ph == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            problems.append(f"{where}: a complete event needs dur >= 0")
    return problems
