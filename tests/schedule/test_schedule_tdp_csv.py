"""TDP's CSV schedules in and out: torch's own dumps round-trip byte for byte, ours round-trip
to the identical IR and load into torch's ``_PipelineScheduleRuntime``; what cannot run is
refused with its cell."""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import pytest

from engine.schedule import Action, ScheduleError, generate, interleaved, validate
from engine.schedule.tdp import from_csv, to_csv
from engine.schedule.vshape import dualpipev, looped_bfs, vhalf, vmin, zbv

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CLASSES = {
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "interleaved": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
}
SIZES = [(2, 4), (2, 8), (3, 6), (4, 8), (2, 5)]


def stand_in_stages(ranks: int, stages: int) -> list[types.SimpleNamespace]:
    """What torch's schedule classes read from their stages to compute every rank's order (as
    torch's own schedule tests do with mock stages): no process group, no model."""
    return [
        types.SimpleNamespace(
            group_size=ranks, group_rank=0, num_stages=stages, stage_index=i,
            submod=torch.nn.Linear(1, 1), is_first=i == 0, is_last=i == stages - 1,
        )
        for i in (0, 1)
    ]


def torch_schedule(kind: str, R: int, M: int, cls: str | None = None):  # noqa: ANN201
    cls_ = getattr(schedules, cls or CLASSES[kind])
    try:
        return cls_(stand_in_stages(R, 2 * R), M, loss_fn=lambda out, target: out)
    except ValueError as exc:  # e.g. DualPipeV needs M >= 2R, interleaved M % R
        pytest.skip(f"torch refuses R={R}, M={M}: {exc}")


def _without_fsdp(text: str) -> str:
    rows = [row.split(",") for row in text.split("\r\n")]
    return "\r\n".join(
        ",".join(c for c in row if "UNSHARD" not in c and "RESHARD" not in c) for row in rows
    )


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("kind", list(CLASSES))
def test_torch_dump_reads_and_writes_back_the_same_file(
    kind: str, size: tuple[int, int], fmt: str, tmp_path: Path
) -> None:
    R, M = size
    path = tmp_path / "torch.csv"
    torch_schedule(kind, R, M)._dump_csv(str(path), format=fmt)
    original = open(path, newline="").read()
    ours = from_csv(path, drop_fsdp=True)
    validate(ours)
    want = original if fmt == "compute_only" else _without_fsdp(original)
    assert to_csv(ours, format=fmt) == want
    assert ours.ranks == R and ours.stages == 2 * R and ours.chunks == M


def test_fsdp_cells_are_refused_naming_the_cell(tmp_path: Path) -> None:
    path = tmp_path / "zbv.csv"
    torch_schedule("zbv", 2, 4)._dump_csv(str(path), format="compute_comms")
    with pytest.raises(ScheduleError, match=r"row 1 \(rank 0\), column 1 \('0UNSHARD'\).*FSDP"):
        from_csv(path)


@pytest.mark.parametrize(
    "make",
    [
        lambda: zbv(2, 4), lambda: zbv(4, 8), lambda: zbv(3, 2), lambda: dualpipev(2, 4),
        lambda: dualpipev(3, 7), lambda: looped_bfs(2, 2, 4), lambda: interleaved(2, 2, 4),
        lambda: interleaved(4, 2, 8), lambda: generate("1f1b", 4, 8),
        lambda: generate("zbh1", 3, 5), lambda: generate("gpipe", 2, 3),
        lambda: vmin(4, 8), lambda: vmin(3, 5), lambda: vhalf(4, 8), lambda: vhalf(3, 5),
    ],
    ids=["zbv-2-4", "zbv-4-8", "zbv-3-2", "dpv-2-4", "dpv-3-7", "bfs", "int-2", "int-4", "1f1b",
         "zbh1", "gpipe", "vmin-4-8", "vmin-3-5", "vhalf-4-8", "vhalf-3-5"],
)
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_ours_round_trip_to_the_identical_program(make, fmt: str, tmp_path: Path) -> None:  # noqa: ANN001
    ours = make()
    text = to_csv(ours, tmp_path / "ours.csv", format=fmt)
    assert (tmp_path / "ours.csv").read_text() == text.replace("\r\n", "\n")
    assert from_csv(text, name=ours.name, order=ours.order) == ours
    assert from_csv(tmp_path / "ours.csv", name=ours.name, order=ours.order) == ours


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("make", [lambda: zbv(2, 4), lambda: dualpipev(2, 6),
                                  lambda: looped_bfs(2, 2, 4), lambda: interleaved(2, 2, 4),
                                  lambda: vmin(3, 6), lambda: vhalf(2, 4)],
                         ids=["zbv", "dualpipev", "looped_bfs", "interleaved", "vmin", "vhalf"])
def test_ours_load_into_torch_runtime(make, fmt: str, tmp_path: Path) -> None:  # noqa: ANN001
    ours = make()
    path = tmp_path / "ours.csv"
    to_csv(ours, path, format=fmt)
    runtime = schedules._PipelineScheduleRuntime(
        stand_in_stages(ours.ranks, ours.stages), ours.chunks, loss_fn=lambda o, t: o
    )
    runtime._load_csv(str(path), format=fmt)  # torch validates the order and the placement
    got = runtime.pipeline_order_with_comms
    assert len(got) == ours.ranks
    # (torch's _simulate cannot be asked: it knows neither REDUCE_GRAD nor UNSHARD, which its
    # own lowering adds; our validator proves the order deadlock-free instead)
    validate(from_csv(path, format=fmt))


@pytest.mark.parametrize("size", [(2, 4), (2, 8), (3, 6), (4, 8), (3, 3)], ids=str)
@pytest.mark.parametrize("kind", ["zbv", "dualpipev", "looped_bfs", "interleaved"])
def test_native_generators_take_torchs_order(kind: str, size: tuple[int, int], tmp_path: Path) -> None:
    """Generated natively, yet each rank's order is exactly torch 2.13's (and its place)."""
    R, M = size
    path = tmp_path / "t.csv"
    torch_schedule(kind, R, M)._dump_csv(str(path), format="compute_only")
    theirs = from_csv(path, name=kind)
    ours = {"zbv": lambda: zbv(R, M), "dualpipev": lambda: dualpipev(R, M),
            "looped_bfs": lambda: looped_bfs(R, 2, M), "interleaved": lambda: interleaved(R, 2, M)}[kind]()
    assert replace(theirs, ticks=None) == replace(ours, ticks=None)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0F0,0X1\n", r"column 2 \('0X1'\): not an action"),
        ("0F0,0I0,0REDUCE_GRAD\n", r"no weight gradient 0W0"),
        ("0F0,0B0,0W0\n", r"whole backward, but 0W0"),
        ("0F0,1F0\n1B0,0B0\n", r"stage 1 also appears on rank 0"),
        ("0F0,0SEND_F0,0F1,0SEND_F1,0REDUCE_GRAD,0RECV_B0,0B0,0RECV_B1,0B1\n"
         "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD\n",
         r"row 1 \(rank 0\), column 5 \('0REDUCE_GRAD'\): REDUCE_GRAD of stage 0 after 0 of its 2"),
        ("0F0,0F1\n1F0,1B0,1F1,1B1\n", r"SB0\): unmatched send.*column 2 \('1B0'\)"),
        ("(0F1;1B0)OVERLAP_F_B\n", r"unmatched send.*column 1"),
        ("(0F0;0W0;0F1)OVERLAP_F_B\n", r"column 1 .*exactly two compute actions"),
        ("0F0,0SEND_F0\n", r"compute_comms|SEND_F"),
    ],
    ids=["token", "i-without-w", "b-with-w", "two-ranks", "early-reduce", "missing-b", "pair", "pair3",
         "comm-in-compute-only"],
)
def test_what_cannot_run_is_refused_with_its_cell(text: str, match: str) -> None:
    fmt = "compute_only" if "SEND_F0\n" in text and "RECV" not in text else None
    with pytest.raises(ScheduleError, match=match):
        from_csv(text, format=fmt)


def _edited(prog, fmt: str, how: str) -> tuple[str, int, int]:
    """The CSV of ``prog`` with rank 0's first backward moved ahead of its forward (``swap``: the
    two cells trade places; ``insert``: the backward cut and put before the forward), or its
    first two forwards swapped (``forwards``); (text, edited row, edited column), 1-based."""
    rows = [r.split(",") for r in to_csv(prog, format=fmt).strip().split("\n")]
    row = rows[0]
    f = row.index("0F0")
    if how == "forwards":
        g = row.index("0F1")
        row[f], row[g] = row[g], row[f]
        return "\n".join(",".join(r) for r in rows) + "\n", 1, f + 1
    b = next(i for i, c in enumerate(row) if c in ("0B0", "0I0"))
    if how == "swap":
        row[f], row[b] = row[b], row[f]
    else:
        row.insert(f, row.pop(b))
    return "\n".join(",".join(r) for r in rows) + "\n", 1, f + 1


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("how", ["swap", "insert"])
@pytest.mark.parametrize("kind", ["1f1b", "zbh1", "zbv", "interleaved"])
def test_a_backward_moved_ahead_of_its_forward_is_reported_at_the_edited_cell(kind: str, how: str, fmt: str) -> None:
    prog = {"1f1b": lambda: generate("1f1b", 4, 8), "zbh1": lambda: generate("zbh1", 4, 8),
            "zbv": lambda: zbv(2, 4), "interleaved": lambda: interleaved(2, 2, 4)}[kind]()
    text, row, col = _edited(prog, fmt, how)
    with pytest.raises(ScheduleError) as info:
        from_csv(text)
    message = str(info.value)
    assert message.startswith(f"CSV row {row} (rank 0), column {col} ('0"), message
    assert "comes before its forward 0F0" in message, message


def test_forwards_swapped_on_one_row_name_that_row_beside_the_receive() -> None:
    """Each order is legal on its own; the receive on the next row meets the wrong send: the
    error names both cells, the edited one among them."""
    text, row, col = _edited(generate("1f1b", 2, 4), "compute_only", "forwards")
    with pytest.raises(ScheduleError, match=rf"row 2 \(rank 1\), column 2 \('1F0'\); the send it meets: "
                                            rf"row {row} \(rank 0\), column {col} \('0F1'\)"):
        from_csv(text)


def test_missing_file_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no CSV file 'nowhere.csv'"):
        from_csv("nowhere.csv")
    with pytest.raises(ValueError, match="format must be one of"):
        from_csv("0F0,0B0\n", format="both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a path or the CSV text"):
        from_csv(3)  # type: ignore[arg-type]
    assert from_csv("0F0,0B0\n").actions[0][-1] == Action.update([0])


def test_a_deadlocking_order_names_its_cell() -> None:
    # rank 1 waits for stage 0's second forward before running the first backward rank 0 needs
    text = "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"
    with pytest.raises(ScheduleError, match=r"deadlock.*CSV row 1 \(rank 0\), column 2 \('0B0'\)"):
        from_csv(text)


def test_to_csv_refuses_what_tdp_cannot_hold() -> None:
    with pytest.raises(ValueError, match="one mini-batch"):
        to_csv(generate("1f1b", 2, 2, steps=2))
    with pytest.raises(ValueError, match="synchronous"):
        to_csv(generate("pb", 2, 2))
    with pytest.raises(ValueError, match="format"):
        to_csv(zbv(2, 4), format="compute")  # type: ignore[arg-type]
