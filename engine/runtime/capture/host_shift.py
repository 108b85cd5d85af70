"""The host bookkeeping of one asynchronous window, applied after a replay.

Why: a replayed graph runs no Python, yet an asynchronous window advances the host's state --
micro-batch ids in the executor's mailboxes and the stages' stashes, weight versions, update
and step counts, dict keys that name micro-batches. :func:`engine.runtime.capture.carry.host_affine`
checks on recorded windows that every such integer advances by the same amount each window;
:class:`HostShift` holds those amounts (the difference between two consecutive windows'
fingerprints) and adds them to the live objects after each replay, walking them in exactly
the order :func:`~engine.runtime.capture.carry.fingerprint` does. The objects themselves are those
the captured window left (a replay makes none), so after the shift the host names every
value it would have named after running the window eagerly -- what a later eager step,
``flush()`` or ``state_dict()`` reads.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from engine.runtime.capture.carry import _PLAIN, MEASURED, _order, fingerprint

__all__ = ["HostShift"]


def _delta(a: Any, b: Any) -> Any:
    """What turns fingerprint ``a`` into ``b`` (None: nothing); raises ValueError where the
    difference is not a shift of integers."""
    if a == b:
        return None
    if a[0] != b[0]:
        raise ValueError(f"{a[:2]} became {b[:2]}")
    kind = a[0]
    if kind == "int":
        return ("int", b[1] - a[1])
    if kind == "obj":
        if [k for k, _ in a[2]] != [k for k, _ in b[2]]:
            raise ValueError(f"the fields of {a[1]} changed")
        fields = {k: d for (k, x), (_, y) in zip(a[2], b[2], strict=True)
                  if (d := _delta(x, y)) is not None}
        return ("obj", fields)
    if kind == "item":
        return ("item", _delta(a[1], b[1]), _delta(a[2], b[2]))
    if kind in ("dict", "list", "tuple", "set"):
        if len(a[1]) != len(b[1]):
            raise ValueError(f"a {kind} of {len(a[1])} entries became {len(b[1])}")
        return (kind, tuple(_delta(x, y) for x, y in zip(a[1], b[1], strict=True)))
    raise ValueError(f"{a!r:.60} became {b!r:.60}")


class HostShift:
    """One window's host difference (module docstring): ``HostShift(before, after)`` from two
    fingerprints of consecutive windows; ``apply(root)`` adds it to the live objects."""

    def __init__(self, before: Any, after: Any) -> None:
        self.delta = _delta(before, after)

    def apply(self, root: Any) -> None:
        seen: set[int] = set()
        new = self._go(root, self.delta, seen)
        if new is not root:
            raise ValueError("the root of the host state is not an object")

    def _go(self, v: Any, d: Any, seen: set[int]) -> Any:
        """``v`` shifted by ``d``: a new value for ints and tuples, ``v`` itself (changed in
        place) for objects, dicts, lists and sets."""
        if d is None:
            return v
        kind = d[0]
        if kind == "int":
            return v + d[1]
        if kind == "obj":
            if id(v) in seen:
                return v
            seen.add(id(v))
            for k, dk in d[1].items():
                if k in MEASURED:
                    continue
                setattr(v, k, self._go(getattr(v, k), dk, seen))
            return v
        if kind == "dict":
            items = _sorted_items(v)
            pairs = []
            for (k, x), di in zip(items, d[1], strict=True):
                if di is None:
                    pairs.append((k, x))
                else:
                    pairs.append((self._go(k, di[1], seen), self._go(x, di[2], seen)))
            v.clear()
            v.update(pairs)
            return v
        if kind == "list":
            for n, dn in enumerate(d[1]):
                if dn is not None:
                    v[n] = self._go(v[n], dn, seen)
            return v
        if kind == "tuple":
            return type(v)(self._go(x, dx, seen) for x, dx in zip(v, d[1], strict=True))
        if kind == "set":
            members = [k for k, _ in _sorted_items(dict.fromkeys(v))]
            shifted = [self._go(x, dx, seen) for x, dx in zip(members, d[1], strict=True)]
            v.clear()
            v.update(shifted)
            return v
        raise ValueError(f"cannot shift a {kind}")


def _int_key(k: Any) -> bool:
    return type(k) is int or (type(k) is tuple and all(type(x) is int for x in k))


def _sorted_items(d: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """``d``'s items in :func:`~engine.runtime.capture.carry.fingerprint`'s order: by value for
    int keys or int tuples (the executor's micro-batch and (stage, micro-batch) keys; fast
    path: a replay shifts hundreds of them), else by the keys' fingerprints."""
    if all(type(k) is int for k in d) or all(type(k) is tuple and _int_key(k) for k in d):
        return sorted(d.items(), key=lambda kv: kv[0])
    return sorted(d.items(), key=lambda kv: _order(("item", _key_print(kv[0]), None)))


def _key_print(k: Any) -> Any:
    """The fingerprint of a dict key or set member (ints and tuples of ints, cheaply)."""
    if isinstance(k, int) and not isinstance(k, bool):
        return ("int", k)
    if isinstance(k, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in k):
        return ("tuple", tuple(("int", x) for x in k))
    if isinstance(k, _PLAIN) or isinstance(k, Tensor):
        return fingerprint(k)
    return fingerprint(k)
