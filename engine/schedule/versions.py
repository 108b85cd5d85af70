"""Which weight version each forward and backward uses, from the order of a stage's actions.

Why derived here and not typed in: ALGORITHMS.md defines delays and weight versions through
t_F and t_B, "the number of updates stage s had applied when F(n) and B(n) ran". Those
counts follow from the per-stage action order alone (clock times do not matter), so the
validator (2BW needs a version that exists), the analysis (D_s, versions held) and the
runtime (which weights to hand to F and B) all read them from this one function.

Per policy (``Schedule.weights``), with versions named by how many updates produced them:

* ``live``: version_F = t_F, version_B = t_B.
* ``stash``: version_F = t_F, version_B = version_F (the stash).
* ``2bw``: version_F = version_B = max(floor(n / M) - 1, 0).

The delay of micro-batch n is ``update - 1 - version_F`` where ``update`` is the 1-based
index of the update that applies n's gradient: the number of updates applied in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.schedule.ir import Kind, Schedule


@dataclass(frozen=True)
class Versions:
    """Update counts and weight versions of one micro-batch on one stage.

    ``t_F``/``t_B``: updates applied on the stage when F(n)/B(n) ran. ``version_F`` /
    ``version_B``: the weight version (number of updates it contains) F/B used.
    ``update``: 1-based index of the update that applied n's gradient (None if never).
    ``f_index``/``b_index``/``u_index``: positions of F(n), B(n) and that U in the stage list.
    """

    stage: int
    mb: int
    t_F: int
    t_B: int
    version_F: int
    version_B: int
    update: int | None
    f_index: int
    b_index: int
    u_index: int | None

    @property
    def delay(self) -> int | None:
        """Updates applied between F(n) reading the weights and the one applying n's gradient."""
        return None if self.update is None else self.update - 1 - self.version_F


def version_of_forward(schedule: Schedule, mb: int, t_F: int) -> int:
    """The weight version F(mb) uses, given t_F updates applied on its stage."""
    if schedule.weights == "2bw":
        return max(mb // schedule.chunks - 1, 0)
    return t_F


def stage_versions(schedule: Schedule, stage: int) -> dict[int, Versions]:
    """Versions for every micro-batch that has both F and B on ``stage`` (first occurrences)."""
    t = 0
    t_F: dict[int, tuple[int, int]] = {}
    t_B: dict[int, tuple[int, int]] = {}
    upd: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(schedule.actions[stage]):
        if a.kind is Kind.FORWARD:
            t_F.setdefault(a.mb, (t, i))
        elif a.kind is Kind.BACKWARD:
            t_B.setdefault(a.mb, (t, i))
        elif a.kind is Kind.UPDATE:
            t += 1
            for m in a.mbs:
                upd.setdefault(m, (t, i))
    out: dict[int, Versions] = {}
    for n in sorted(set(t_F) & set(t_B)):
        tf, fi = t_F[n]
        tb, bi = t_B[n]
        vf = version_of_forward(schedule, n, tf)
        vb = tb if schedule.weights == "live" else vf
        u, ui = upd.get(n, (None, None))
        out[n] = Versions(stage, n, tf, tb, vf, vb, u, fi, bi, ui)
    return out
