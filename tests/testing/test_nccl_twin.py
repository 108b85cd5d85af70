"""The NCCL twin (engine.testing.nccl_twin) enforces the NCCL rules it claims: each test says
which rule it covers and would fail without it. One 4-process spawn runs every case
(tests/nccl_twin_support.py; ~30 s on 2 busy cores): the two-rank scenarios run on the pairs
(0, 1) and (2, 3) at once, the deadlock limit is 1.5 s."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nccl_twin_support import DEADLOCK_S, WORLD, inputs, peer_of, spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

CASES = [
    "fused", "lone_isends", "lone_batches", "two_groups", "cross_comm", "coll_behind_send",
    "coll_other_group", "tags", "mismatch", "dtypes", "alone", "collectives", "dtensor", "timeout",
    "abort", "peer_exit",  # peer_exit ends the odd ranks: last
]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    res = spawn(CASES)
    for r, got in enumerate(res):
        assert got, f"rank {r} wrote nothing"
        assert "fatal" not in got, f"rank {r}: {got.get('fatal')}"
    return [{name: _case(got, r, name) for name in got if not name.endswith(".seconds")}
            for r, got in enumerate(res)]


def _case(got: dict[str, Any], rank: int, name: str) -> Any:
    """A case's results, or (read by the test of that case only) its error."""
    return got[name] if "error" not in got[name] else _Broken(rank, name, got[name]["error"])


class _Broken(dict):  # type: ignore[type-arg]
    """A case that raised: any read of its results fails with the traceback."""

    def __init__(self, rank: int, name: str, error: str) -> None:
        super().__init__()
        self.text = f"rank {rank}, case {name} raised:\n{error}"

    def __getitem__(self, key: object) -> Any:
        raise AssertionError(self.text)


def _deadlocked(runs: list[dict[str, Any]], case: str) -> list[str]:
    msgs = []
    for r, res in enumerate(runs):
        got = res[case]
        assert got["raised"] == "DeadlockError", (r, case, got)
        assert got["message"].startswith("NCCL twin: deadlock"), got["message"]  # this case's
        assert DEADLOCK_S <= got["seconds"] < DEADLOCK_S + 10, (r, case, got["seconds"])
        msgs.append(got["message"])
    return msgs


def test_lone_isends_deadlock_naming_every_head(runs: list[dict[str, Any]]) -> None:
    """Rules 2, 4 and 8: a lone isend ahead of its irecv on the pair's communicator cannot
    complete (no eager buffer; the irecv queues behind it), so every rank stops with a report
    naming each rank's head op, peer, group, sequence number, shape and label. With an eager
    buffer, or without the in-order queue, the ops would complete."""
    for r, msg in enumerate(_deadlocked(runs, "lone_isends")):
        assert "deadlock" in msg
        for q in range(WORLD):
            p = peer_of(q)
            assert f"rank {q}: waiting on" in msg, (r, msg)
            assert re.search(rf"2-rank communicator {min(q, p)}:{max(q, p)} of group '\d+' "
                             rf"\(global ranks {min(q, p)}, {max(q, p)}", msg), msg
            assert f"send to rank {p} #0, float32[3], label 'act mb {q}' [running; waits for rank {p} to run the matching recv]" in msg, (r, q, msg)
        assert f"Raised on rank {r} for its entry #1" in msg
        got = runs[r]["lone_isends"]
        assert got["send"]["raised"] == got["future"]["raised"] == got["exception"] == "DeadlockError"
        assert not got["polled"] and got["completed"]  # rule 7: a failed work is completed


def test_single_op_batches_deadlock_like_lone_ops(runs: list[dict[str, Any]]) -> None:
    """Rules 1, 2 and 4: two one-op ``batch_isend_irecv`` lists are two entries on the group's
    communicator, in posting order, so the send-first lists deadlock too; each list gives one
    work, as ProcessGroupNCCL's coalesced list does."""
    for r, msg in enumerate(_deadlocked(runs, "lone_batches")):
        assert re.search(r"entry #0 on the communicator of group '\d+' \(global ranks \[0, 1, 2, 3\]\): "
                         rf"batch_isend_irecv \[send to rank {peer_of(r)} #0", msg), msg
        assert runs[r]["lone_batches"]["works"] == (1, 1)


def test_fused_batch_completes_with_the_right_data(runs: list[dict[str, Any]]) -> None:
    """Rule 4: the same sends and receives in one ``batch_isend_irecv`` list progress together
    and complete; two sends to one peer match its two receives in order. Rule 7: one work for
    the list, completed, its future holding the list's tensors."""
    for r, res in enumerate(runs):
        got, p = res["fused"], peer_of(r)
        assert got["works"] == 1
        assert torch.equal(got["b1"], torch.arange(3.0) + 10 * p)
        assert torch.equal(got["b2"], torch.arange(5.0) + 100 * p)
        # rule 7: the list's one work, its future holding the list's tensors
        assert got["completed"] and got["exception"] is None
        assert [t.tolist() for t in got["future"]] == [
            (torch.arange(3.0) + 10 * r).tolist(), (torch.arange(5.0) + 100 * r).tolist(),
            got["b1"].tolist(), got["b2"].tolist()]


def test_communicators_are_independent_queues(runs: list[dict[str, Any]]) -> None:
    """Rules 1 and 2: a send on group 1 and the opposite send on group 2, each posted before
    its rank's receive, complete: each group has its own communicator and queue. (One group
    with the same order deadlocks: test_single_op_batches_deadlock_like_lone_ops.)"""
    for r, res in enumerate(runs):
        got = res["two_groups"]
        assert got["raised"] is None, got
        assert torch.equal(got["value"], torch.full((2,), float(peer_of(r))))


def test_a_receive_on_another_communicator_does_not_complete_a_send(runs: list[dict[str, Any]]) -> None:
    """Rule 1: an isend on group 1 and its peer's irecv on group 2 use different 2-rank
    communicators and never match: a deadlock, not a transfer."""
    for r, msg in enumerate(_deadlocked(runs, "cross_comm")):
        lo = r - r % 2
        groups = [re.search(rf"rank {q}: waiting on entry #0 on the 2-rank communicator {lo}:{lo + 1} "
                            rf"of group '(\d+)'", msg) for q in (lo, lo + 1)]
        assert all(groups) and groups[0][1] != groups[1][1], msg  # type: ignore[index]
        assert f"send to rank {lo + 1} #0" in msg and f"recv from rank {lo} #0" in msg


def test_a_collective_queues_behind_a_pending_send(runs: list[dict[str, Any]]) -> None:
    """Rule 5: an all_reduce posted after an unmatched send on the same group waits for it,
    while the receiver waits in the all_reduce: a deadlock naming both heads."""
    for r, msg in enumerate(_deadlocked(runs, "coll_behind_send")):
        assert "all_reduce #0, float32[1] SUM" in msg, msg
        assert re.search(r"batch_isend_irecv \[send to rank 1 #0, float32\[2\]\] \[running; waits "
                         r"for rank 1 to run the matching recv\]; 1 more queued behind it", msg), msg


def test_a_collective_on_another_group_passes_a_pending_send(runs: list[dict[str, Any]]) -> None:
    """Rules 1 and 5: the same all_reduce on a second group runs beside the pending send, and
    the send completes once its receive is posted."""
    for r, res in enumerate(runs):
        got = res["coll_other_group"]
        assert got["raised"] is None, got
        x, b = got["value"]
        assert torch.equal(x, torch.tensor([6.0]))
        assert torch.equal(b, torch.full((2,), 7.0) if r % 2 else torch.zeros(2))


def test_tags_are_ignored(runs: list[dict[str, Any]]) -> None:
    """Rule 3: sends tagged 5 then 3 match receives tagged 3 then 5 in posting order (gloo,
    which honours tags, would swap them)."""
    for r in range(1, WORLD, 2):
        got = runs[r]["tags"]
        assert got["raised"] is None, got
        first, second = got["value"]
        assert torch.equal(first, torch.full((2,), 5.0)) and torch.equal(second, torch.full((2,), 3.0))


@pytest.mark.parametrize("what, theirs", [("size", "float32[5] (5 elements)"), ("dtype", "int32[4]")])
def test_size_and_dtype_mismatch_raise_on_both_ranks(runs: list[dict[str, Any]], what: str, theirs: str) -> None:
    """Rule 3: ends that disagree on count or dtype both raise, naming both ranks, the
    communicator, the sequence number, both shapes and dtypes."""
    for r, res in enumerate(runs):
        got = res["mismatch"][what]
        assert got["raised"] == "MismatchError", got
        lo = r - r % 2
        msg = got["message"]
        assert f"from rank {lo} to rank {lo + 1}" in msg and "#0" in msg, msg
        assert f"rank {lo} sends float32[4]" in msg and f"rank {lo + 1} receives into {theirs}" in msg, msg
        assert f"2-rank communicator {lo}:{lo + 1}" in msg


def test_dtypes_and_tensors_as_process_group_nccl(runs: list[dict[str, Any]]) -> None:
    """Rule 6: int16 raises ProcessGroupNCCL's TypeError at the call; non-contiguous tensors
    and BAND raise its ValueError, AVG of bools its TypeError; bool rides as uint8 (a SUM is an
    OR), complex as its real view."""
    for r, res in enumerate(runs):
        got, p = res["dtypes"], peer_of(r)
        short = "Input tensor data type is not supported for NCCL process group: Short"
        for case in ("int16 isend", "int16 all_reduce"):
            assert (got[case]["raised"], got[case]["message"]) == ("TypeError", short)
        assert got["non-contiguous"]["raised"] == "ValueError"
        assert "Tensors must be contiguous" in got["non-contiguous"]["message"]
        assert got["BAND"]["raised"] == "ValueError" and "ReduceOp.BAND" in got["BAND"]["message"]
        assert got["bool AVG"]["message"] == "Cannot use ReduceOp.AVG with boolean inputs"
        assert torch.equal(got["bool or"], torch.tensor([True, False, True, True]))
        assert torch.equal(got["bool recv"], torch.tensor([True, False, p % 2 == 0]))
        assert torch.equal(got["complex recv"], torch.complex(torch.arange(3.0) + p, -torch.arange(3.0)))
        assert torch.equal(got["complex sum"], torch.complex(torch.tensor([6.0]), torch.tensor([8.0])))


def test_a_one_rank_group_runs_alone(runs: list[dict[str, Any]]) -> None:
    """Rules 4 and 5 at their edge: a one-rank group's all_reduce completes with no frames,
    and a ``batch_isend_irecv`` list sending to its own rank matches within the list."""
    for r, res in enumerate(runs):
        got = res["alone"]
        assert torch.equal(got["sum"], torch.full((3,), float(r)))
        assert torch.equal(got["b"], torch.arange(4.0) + r)


def test_group_timeout_and_wait_timeout(runs: list[dict[str, Any]]) -> None:
    """Rule 7: a receive whose peer never sends (the peer awake, so no deadlock) fails with
    "timed out" after the group's 1.5 s timeout (the watchdog), and ``wait(timeout=0.5 s)``
    after 0.5 s."""
    for r in range(0, WORLD, 2):
        got = runs[r]["timeout"]
        for what, limit in (("group", 1.5), ("wait", 0.5)):
            assert got[what]["raised"] == "TwinTimeoutError", got
            assert "timed out" in got[what]["message"] and f"recv from rank {r + 1}" in got[what]["message"]
            assert limit <= got[what]["seconds"] < limit + 3, got[what]


def test_abort_fails_own_waits_and_tells_the_peer(runs: list[dict[str, Any]]) -> None:
    """Rule 9: ``pg.abort()`` fails the rank's own pending receive and every later op of the
    group; the peer waiting on it raises naming it at once, not at the timeout."""
    for r, res in enumerate(runs):
        got = res["abort"]
        if r % 2:
            assert got["peer"]["raised"] == "PeerLeftError", got
            assert f"rank {r - 1} left group" in got["peer"]["message"] and "aborted" in got["peer"]["message"]
            assert got["peer"]["seconds"] < 3.0
        else:
            for case in ("own", "after"):
                assert got[case]["raised"] == "TwinError" and "aborted (pg.abort())" in got[case]["message"]


def test_a_peer_that_exits_is_named_within_seconds(runs: list[dict[str, Any]]) -> None:
    """Rule 9: a rank whose peer's process exits while it waits on a receive from it raises a
    PeerLeftError naming the peer (the peer exits 0.5 s into the case)."""
    for r in range(0, WORLD, 2):
        got = runs[r]["peer_exit"]
        assert got["raised"] == "PeerLeftError", got
        assert f"rank {r + 1} left the job" in got["message"]
        assert got["seconds"] < 5.0, got


def _fold(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out = {"SUM": torch.add, "PRODUCT": torch.mul, "MAX": torch.maximum, "MIN": torch.minimum}[op](out, x)
    return out


REPLICATED = ("all_reduce", "two-rank", "broadcast", "all_gather")


def test_collectives_equal_gloo_bit_for_bit(runs: list[dict[str, Any]]) -> None:
    """Rule 5: where the result does not depend on the reduction order (integers, MAX/MIN,
    moves, two-rank float sums, objects), every collective equals gloo's on the same inputs,
    and every rank holds the same bits."""
    exact = [k for k in runs[0]["collectives"] if "float32" not in k]
    exact += ["all_reduce MAX torch.float32", "all_reduce MIN torch.float32"]
    for r, res in enumerate(runs):
        for name in exact:
            if (name == "two-rank SUM" and r >= 2) or (name == "reduce" and r != 0):
                continue  # not a member; reduce leaves non-roots' tensors unspecified
            twin, gloo = res["collectives"][name]
            assert _same(twin, gloo), (r, name, twin, gloo)
            if name.startswith(REPLICATED):  # the same bits on every member
                assert _same(twin, runs[r ^ 1]["collectives"][name][0]), (r, name)


def test_float_reductions_fold_in_group_rank_order(runs: list[dict[str, Any]]) -> None:
    """Rule 5: 4-rank float SUM, PRODUCT and AVG equal the left fold in group-rank order bit
    for bit on every rank (inputs chosen so that another order changes the bits). Gloo's ring
    order differs; how many elements differ is printed, not asserted."""
    xs = [inputs(q, torch.float32) for q in range(WORLD)]
    assert not torch.equal(_fold(xs, "SUM"), _fold(xs[::-1], "SUM"))  # the order shows
    for op in ("SUM", "PRODUCT"):
        for r, res in enumerate(runs):
            twin, gloo = res["collectives"][f"all_reduce {op} torch.float32"]
            assert torch.equal(twin, _fold(xs, op)), (r, op)
            if r == 0:
                print(f"{op}: {int((twin != gloo).sum())} of {twin.numel()} elements differ from gloo's")
    avg = _fold([x * (1.0 / WORLD) for x in xs], "SUM")
    for res in runs:
        assert torch.equal(res["collectives"]["all_reduce AVG torch.float32"][0], avg)


def test_dtensor_redistributes_on_a_2x2_twin_mesh(runs: list[dict[str, Any]]) -> None:
    """Rule 5 through functional collectives: on ``init_device_mesh("cpu", (2, 2))`` over the
    twin, Shard -> Replicate (all-gather), Partial -> Replicate (all-reduce) and Partial ->
    Shard (reduce-scatter) give the right values."""
    for r, res in enumerate(runs):
        got = res["dtensor"]
        assert got["groups"] == ["TwinProcessGroup", "TwinProcessGroup"]
        assert got["gathered_equal"]
        total = float(r + 1 + (r ^ 2) + 1)  # mesh dim 0 pairs ranks r and r ^ 2
        assert torch.equal(got["reduced"], torch.full((4, 3), total))
        assert torch.equal(got["scattered"], torch.full((2, 3), total))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ---------------------------------------------------------------------- in this process


def test_op_label_is_the_innermost_label_and_resets() -> None:
    """engine.op_label: what the twin records at posting time."""
    from engine.op_label import OP_LABEL, labelled

    assert OP_LABEL.get() is None
    with labelled("act mb 3 stage 1->2"):
        with labelled("grad mb 3"):
            assert OP_LABEL.get() == "grad mb 3"
        assert OP_LABEL.get() == "act mb 3 stage 1->2"
    assert OP_LABEL.get() is None
    with pytest.raises(TypeError, match="an op label is a str, got int: 3"):
        with labelled(3):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("raw", ["abc", "0", "-2"])
def test_deadlock_limit_must_be_positive(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from engine.testing import nccl_twin

    monkeypatch.setenv(nccl_twin.DEADLOCK_ENV, raw)
    with pytest.raises(ValueError, match=f"ENGINE_NCCL_TWIN_DEADLOCK_S must be a positive number of seconds, got '{raw}'"):
        nccl_twin.deadlock_seconds()
    monkeypatch.setenv(nccl_twin.DEADLOCK_ENV, "2.5")
    assert nccl_twin.deadlock_seconds() == 2.5


def test_tensor_rules_raise_process_group_nccl_errors() -> None:
    """Rule 6 without processes: the dtypes NCCL lacks, sparse and non-contiguous tensors."""
    from engine.testing.nccl_twin.dtypes import check_tensor

    for dtype, name in ((torch.int16, "Short"), (torch.uint16, "UInt16"), (torch.uint32, "UInt32")):
        with pytest.raises(TypeError, match=f"^Input tensor data type is not supported for NCCL process group: {name}$"):
            check_tensor(torch.zeros(2, dtype=dtype), "t", collective=True)
    with pytest.raises(ValueError, match="Tensors must be CPU and dense"):
        check_tensor(torch.zeros(2).to_sparse(), "t", collective=True)
    with pytest.raises(ValueError, match="Tensors must be contiguous"):
        check_tensor(torch.zeros(3, 2).t(), "t", collective=False)
    c = torch.zeros(2, dtype=torch.complex64)
    assert check_tensor(c, "t", collective=True).dtype == torch.float32
    assert check_tensor(torch.zeros(2, dtype=torch.bool), "t", collective=True).dtype == torch.bool


def test_import_registers_once_and_leaves_other_groups_to_torch() -> None:
    """The wrapper of batch_isend_irecv is installed once and hands non-twin input to torch's."""
    from engine.testing import nccl_twin

    nccl_twin.register()
    nccl_twin.register()
    assert dist.Backend._plugins["NCCL_TWIN"].extended_api  # type: ignore[attr-defined]
    assert dist.batch_isend_irecv is nccl_twin.batch_isend_irecv
    assert dist.distributed_c10d.batch_isend_irecv is nccl_twin.batch_isend_irecv
    with pytest.raises(ValueError, match="Invalid ``p2p_op_list``"):  # torch's own check
        dist.batch_isend_irecv(["not an op"])  # type: ignore[list-item]
