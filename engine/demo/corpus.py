"""The language-model corpus: structured English-like text made by a seeded generator.

Why generated: the LM task must give the same bytes on every machine, work offline and ship
nothing large. A grammar driven by a fixed integer generator (splitmix64, pure Python
integer arithmetic, so no library or platform can change the stream) produces the text, and
``tests/demo/test_lm.py`` checks its sha256. Licence: the text is produced by this project's own
code (the project's licence); no third-party text is involved.

What it contains, so that there is structure to learn at several ranges: sentences with
subject-verb agreement ("the small cat sees a dog." / "the cats see the dog."), the verb's
ending depending on a noun several characters back; additions written out ("three plus four
is seven."), whose answer depends on both operands; and counting runs ("two three four five."),
each word fixed by the previous one. Lines are sentences; the alphabet is lowercase letters,
space, '.' and newline.
"""

from __future__ import annotations

import hashlib

__all__ = ["ALPHABET", "CORPUS_BYTES", "CORPUS_SEED", "generate_corpus", "corpus_sha256", "encode"]

#: the characters the generator writes, in token-id order
ALPHABET = "\n ." + "abcdefghijklmnopqrstuvwxyz"
CORPUS_SEED = 2026
CORPUS_BYTES = 30_000

_MASK = (1 << 64) - 1
_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen"
).split()
_ADJ = "small big red old quick lazy green happy".split()
_NOUNS = "cat dog fox bird horse mouse child farmer".split()
_PLURAL = {"child": "children", "fox": "foxes", "mouse": "mice"}
_VERBS = (("see", "sees"), ("chase", "chases"), ("like", "likes"), ("find", "finds"), ("help", "helps"))
_DETS = ("the", "a")


class _SplitMix64:
    """Steele et al.'s splitmix64: a 64-bit integer generator with the same stream everywhere."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def below(self, n: int) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) % n


def _noun_phrase(r: _SplitMix64) -> tuple[str, bool]:
    plural = r.below(2) == 1
    noun = _NOUNS[r.below(len(_NOUNS))]
    noun = _PLURAL.get(noun, noun + "s") if plural else noun
    det = "the" if plural else _DETS[r.below(2)]
    adj = _ADJ[r.below(len(_ADJ))] + " " if r.below(2) else ""
    return f"{det} {adj}{noun}", plural


def _sentence(r: _SplitMix64) -> str:
    kind = r.below(4)
    if kind < 2:
        subject, plural = _noun_phrase(r)
        verb = _VERBS[r.below(len(_VERBS))][0 if plural else 1]
        obj, _ = _noun_phrase(r)
        return f"{subject} {verb} {obj}."
    if kind == 2:
        a, b = r.below(10), r.below(10)
        return f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}."
    start = r.below(len(_NUMBERS) - 4)
    return " ".join(_NUMBERS[start : start + 2 + r.below(3)]) + "."


def generate_corpus(size: int = CORPUS_BYTES, seed: int = CORPUS_SEED) -> bytes:
    """The first ``size`` bytes of the corpus for ``seed`` (ASCII, one sentence per line)."""
    r = _SplitMix64(seed)
    parts: list[str] = []
    n = 0
    while n < size:
        line = _sentence(r) + "\n"
        parts.append(line)
        n += len(line)
    return "".join(parts).encode("ascii")[:size]


def corpus_sha256(size: int = CORPUS_BYTES, seed: int = CORPUS_SEED) -> str:
    return hashlib.sha256(generate_corpus(size, seed)).hexdigest()


def encode(text: bytes) -> list[int]:
    """Token ids (positions in :data:`ALPHABET`) of ``text``; other bytes are an error."""
    index = {ord(c): i for i, c in enumerate(ALPHABET)}
    try:
        return [index[b] for b in text]
    except KeyError as exc:
        raise ValueError(f"byte {exc.args[0]!r} is not in the corpus alphabet") from None
