"""ZB-V, DualPipeV, looped BFS and schedules imported from torch's CSV dumps, run in one
process: validated before they run, and (all synchronous) equal to the unpipelined model's
training -- plain stages, tied weights, tensor trees; an overlapped pair runs F then B."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from distributed_support import tied_stages, token_batch
from test_runtime_sync import _model
from test_runtime_trees import ProbeStage
from test_schedule_tdp_csv import CLASSES, torch_schedule
from torch import nn

from engine import Pipeline
from engine.errors import ScheduleError
from engine.schedule import analyze, dualpipev, from_csv, looped_bfs, zbv
from engine.schedule.text import format_schedule, parse


def _opt(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)


def _equals_unpipelined(program, checkpoint: str = "never", steps: int = 3) -> Pipeline:  # noqa: ANN001
    S, M = program.stages, program.chunks
    stages = _model(S)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = Pipeline(stages, chunks=M, loss_fn=nn.functional.mse_loss, schedule=program,
                    optimizer=_opt, checkpoint=checkpoint)
    ropt = _opt(list(ref.parameters()))
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(2 * M, 4, generator=g), torch.randn(2 * M, 2, generator=g)
        loss = pipe.step(x, y)
        ropt.zero_grad()
        rloss = nn.functional.mse_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        torch.testing.assert_close(loss, rloss.detach(), rtol=1e-6, atol=1e-7)
    for a, b in zip([p for st in stages for p in st.parameters()], ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert pipe.stats()["delays"] == [0] * S
    return pipe


PROGRAMS = {
    "zbv-2-4": lambda: zbv(2, 4), "zbv-2-2": lambda: zbv(2, 2), "zbv-3-5": lambda: zbv(3, 5),
    "zbv-2-4-T2": lambda: zbv(2, 4, steps=2), "dualpipev-2-4": lambda: dualpipev(2, 4),
    "dualpipev-3-7": lambda: dualpipev(3, 7), "dualpipev-2-4-T2": lambda: dualpipev(2, 4, steps=2),
    "looped_bfs-2-2-3": lambda: looped_bfs(2, 2, 3), "looped_bfs-2-3-4": lambda: looped_bfs(2, 3, 4),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_generated_equals_unpipelined(name: str) -> None:
    program = PROGRAMS[name]()
    checkpoint = ["never", "except_last", "always"][len(name) % 3]
    pipe = _equals_unpipelined(program, checkpoint)
    assert pipe.spec.program == program


@pytest.mark.parametrize("kind", list(CLASSES))
def test_torch_csv_dumps_run_equal_to_unpipelined(kind: str, tmp_path: Path) -> None:
    """The done-when of issue 25 (locally): what torch 2.13's classes dump runs here."""
    for fmt in ("compute_only", "compute_comms"):
        path = tmp_path / f"{kind}-{fmt}.csv"
        torch_schedule(kind, 2, 4)._dump_csv(str(path), format=fmt)
        program = from_csv(path, name=kind, drop_fsdp=True)
        _equals_unpipelined(program, "except_last", steps=2)


def test_families_by_name_and_bubble_stats() -> None:
    for name, kw in (("zbv", {}), ("dualpipev", {}), ("looped_bfs", {"virtual_stages": 2})):
        pipe = Pipeline(_model(4), chunks=4, loss_fn=nn.functional.mse_loss, schedule=name,
                        optimizer=_opt, **kw)
        pipe.step(torch.randn(8, 4), torch.randn(8, 2))
        assert pipe.spec.synchronous and pipe.spec.program.ranks == 2
    # the runtime's unit-cost bubble follows the V placement (rank r holds r and 2R-1-r)
    pipe = _equals_unpipelined(zbv(2, 4), steps=1)
    assert pipe.stats()["bubble_fraction"] == pytest.approx(analyze(zbv(2, 4)).bubble_fraction)


@pytest.mark.parametrize("make", [lambda: zbv(2, 4), lambda: dualpipev(2, 4)], ids=["zbv", "dualpipev"])
def test_tied_weights_equal_the_unpipelined_tied_model(make) -> None:  # noqa: ANN001
    """Embedding and head tied: with the V both live on rank 0 (stages 0 and 3)."""
    program = make()
    M = program.chunks
    pipe = Pipeline(tied_stages(4), schedule=program, chunks=M,
                    loss_fn=nn.functional.cross_entropy, optimizer=_opt)
    ref = nn.Sequential(*tied_stages(4))
    opt = _opt(list(ref.parameters()))
    for t in range(3):
        x, y = token_batch(t)
        pipe.step(x, y)
        opt.zero_grad()
        for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.cross_entropy(ref(xc), yc) / M).backward()
        opt.step()
    a, b = pipe.stages[0].module.embed.weight, pipe.stages[-1].module.weight
    assert a is not b and torch.equal(a, b)
    torch.testing.assert_close(a, ref[0].embed.weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: zbv(2, 2), lambda: dualpipev(2, 4)], ids=["zbv", "dualpipev"])
def test_tensor_trees_equal_1f1b(make) -> None:  # noqa: ANN001
    """(h, mask) tuples between stages, the same training as 1f1b on the same stages."""
    program = make()
    S, M = program.stages, program.chunks

    def pipe(schedule: object) -> Pipeline:
        torch.manual_seed(0)
        mods = [ProbeStage(s, s == S - 1) for s in range(S)]
        return Pipeline(mods, schedule=schedule, chunks=M, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))

    a, b = pipe(program), pipe("1f1b")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        h, mask = torch.randn(2 * M, 3, generator=g), (torch.rand(2 * M, 3, generator=g) > 0.3).float()
        y = torch.randn(2 * M, 1, generator=g)
        torch.testing.assert_close(a.step((h, mask), y), b.step((h, mask), y), rtol=1e-6, atol=1e-7)
    for p, q in zip([p for st in a.stages for p in st.module.parameters()],
                    [p for st in b.stages for p in st.module.parameters()], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_overlapped_pair_runs_forward_then_backward() -> None:
    program = dualpipev(2, 4)
    pipe = Pipeline(_model(4), chunks=4, loss_fn=nn.functional.mse_loss, schedule=program,
                    optimizer=_opt)
    ran: list[tuple[int, str, int]] = []
    pipe.parts.executor.action_hook = lambda s, kind, n: ran.append((s, kind, n))
    pipe.step(torch.randn(8, 4), torch.randn(8, 2))
    assert program.overlaps
    for sa, a, sb, b in program.overlaps:
        rank = program.rank_of(sa)
        mine = [r for r in ran if program.rank_of(r[0]) == rank]
        i = mine.index((sa, a.kind.value, a.mb))
        assert mine[i + 1] == (sb, b.kind.value, b.mb), (sa, a, sb, b)


def test_broken_program_is_refused_before_anything_runs() -> None:
    text = format_schedule(zbv(2, 4)).replace("placement=0+3,1+2", "placement=0+2,1+3")
    with pytest.raises(ValueError, match="rank 0's order names virtual stage 2 0 times"):
        parse(text)
    stages = _model(4)
    before = [p.detach().clone() for m in stages for p in m.parameters()]
    with pytest.raises(ScheduleError, match="deadlock"):
        Pipeline(stages[:2], chunks=2, loss_fn=nn.functional.mse_loss, optimizer=_opt,
                 schedule=parse("schedule bad stages=2 chunks=2 steps=1 update_size=2 order=x "
                                "weights=live ticks=0\ns0: F0 B0 F1 B1 U0-1\ns1: F0 F1 B0 B1 U0-1\n"))
    assert all(torch.equal(p, q) for p, q in zip(before, [p for m in stages for p in m.parameters()]))


def test_any_placement_map_is_followed() -> None:
    """Contiguous blocks (rank 0 holds stages 0 and 1, rank 1 stages 2 and 3), neither
    round-robin nor V: each rank runs its first stage's forwards, its second's, then the
    backwards in reverse (looped BFS's order on these blocks)."""
    from engine.schedule import Action, Kind, simulate, to_csv
    from engine.schedule.ranked import build

    M, place = 3, ((0, 1), (2, 3))
    units = [
        [((s, Action.forward(m)),) for s in held for m in range(M)]
        + [((s, Action(Kind.BACKWARD, (m,))),) for s in reversed(held) for m in range(M)]
        for held in place
    ]
    program = build("blocks", place, M, units)
    assert program.placement == place and [program.rank_of(s) for s in range(4)] == [0, 0, 1, 1]
    tl = simulate(program)  # one lane per rank: rank 0's two stages never overlap in time
    spans = sorted((tl.start[s][i], tl.end[s][i]) for s in (0, 1) for i in range(len(tl.start[s]))
                   if program.actions[s][i].kind.is_compute)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert parse(format_schedule(program)) == program
    assert from_csv(to_csv(program), name="blocks") == program
    _equals_unpipelined(program, "except_last", steps=2)


@pytest.mark.parametrize("name", ["dualpipev-2-4", "dualpipev-3-7", "dualpipev-2-4-T2", "zbv-3-5",
                                  "torch-dualpipev", "torch-zbv"])
def test_stats_bubble_equals_the_analysis(name: str, tmp_path: Path) -> None:
    """pipe.stats()["bubble_fraction"] replays what ran with unit costs; it equals analyze()'s
    for the same program: an unsplit backward of DualPipeV counts 2 units (a split one 1, its
    W 1), and an overlapped F;B pair starts when both halves can, as the simulator charges."""
    if name.startswith("torch-"):
        path = tmp_path / "t.csv"
        # compute_only: torch's compute_comms dump of DualPipeV places blocking receives early,
        # which the analysis charges (makespan 36 vs 26) and the replay of computation does not
        torch_schedule(name[6:], 2, 4)._dump_csv(str(path), format="compute_only")
        program = from_csv(path, drop_fsdp=True)
    else:
        program = PROGRAMS[name]()
    S, M = program.stages, program.chunks
    pipe = Pipeline(_model(S), chunks=M, loss_fn=nn.functional.mse_loss, schedule=program,
                    optimizer=_opt)
    g = torch.Generator().manual_seed(5)
    for _ in range(program.steps):
        pipe.step(torch.randn(2 * M, 4, generator=g), torch.randn(2 * M, 2, generator=g))
    assert pipe.stats()["bubble_fraction"] == pytest.approx(analyze(program).bubble_fraction, abs=1e-12)
