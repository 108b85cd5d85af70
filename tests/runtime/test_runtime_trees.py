"""Tensor trees between stages: stages pass tuples, dicts and lists of tensors (hidden states,
integer masks and ids, floats that need no gradient, constants); the calling convention
(tuple -> positional, dict -> keyword, anything else -> one argument); gradients only for the
leaves that require grad; transparency of the synchronous schedules against the unpipelined
model; every schedule with the probe; gloo equal to local bit for bit; bad inputs refused
with errors naming the leaf, nothing changed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from distributed_support import spawn
from schedules import ALL, VARIANTS
from test_runtime_support import History, reads
from test_runtime_versions import check_versions
from torch import nn

from engine import Pipeline
from engine.errors import PipelineInputError, ShapeAgreementError
from engine.runtime.stage import trees
from engine.testing import Probe

D, T, VOCAB = 6, 5, 13
SCHEDULES = list(ALL)


class Embed(nn.Module):
    """Stage 0, called with the inputs dict as keywords: a tuple out (positional next)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, T))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
        h = self.embed(ids) * scale
        bias = self.pos.expand(ids.shape[0], T)  # float, no gradient
        return h, mask, bias, ids


class Block(nn.Module):
    """Masked mixing over the sequence; returns a dict (keywords next) with a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.tok = nn.Embedding(VOCAB, 1)

    def forward(self, h, mask, bias, ids):
        m = mask.unsqueeze(-1).to(h.dtype)
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1.0)
        h = torch.tanh(self.lin(h + ctx) + bias.unsqueeze(-1) + self.tok(ids))
        return {"h": h, "mask": mask, "bias": bias, "depth": 2}


class Mixer(nn.Module):
    """Keywords in, a list out (passed to the next stage as one argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h, mask, bias, depth):
        assert depth == 2
        return [torch.tanh(self.lin(h)) * mask.unsqueeze(-1) + 0.1 * bias.unsqueeze(-1), mask]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(D, 2)

    def forward(self, hm):
        h, mask = hm
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.out((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Embed(), Block(), Mixer(), Head()]


class Unpipelined(nn.Module):
    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        for part in self.parts:
            x = trees.call(part, x)
        return x


def loss_fn(out: torch.Tensor, t: dict) -> torch.Tensor:
    return (t["weight"] * (out - t["y"]).pow(2).sum(1)).mean()


def batch(step: int, B: int = 8, scale: float = 1.0):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    inputs = {"ids": ids, "mask": mask, "scale": scale}
    targets = {"y": torch.randn(B, 2, generator=g), "weight": torch.rand(B, generator=g)}
    return inputs, targets


def sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def pipe_of(schedule: str, **kw) -> Pipeline:
    kw.setdefault("chunks", 4)
    return Pipeline(stages(), schedule=schedule, loss_fn=loss_fn, optimizer=sgd, **kw)


def snapshot(pipe: Pipeline) -> list[torch.Tensor]:
    out = [t.detach().clone() for st in pipe.stages for t in st.module.state_dict().values()]
    for st in pipe.stages:
        if st.bridge is None:  # a stage without parameters has no optimizer
            continue
        for s in st.optimizer.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------- transparency


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sync_trees_equal_the_unpipelined_model(schedule: str, checkpoint: str) -> None:
    """Same math as the reference (per-micro-batch backwards of loss/M): weights bitwise equal."""
    M = 4
    pipe = pipe_of(schedule, chunks=M, checkpoint=checkpoint)
    ref = Unpipelined(stages())
    ropt = sgd(ref.parameters())
    for t in range(3):
        x, y = batch(t)
        loss = pipe.step(x, y)
        ropt.zero_grad()
        xs = [{k: v[i * 2 : (i + 1) * 2] if torch.is_tensor(v) else v for k, v in x.items()} for i in range(M)]
        ys = [{k: v[i * 2 : (i + 1) * 2] for k, v in y.items()} for i in range(M)]
        rlosses = []
        for xi, yi in zip(xs, ys, strict=True):
            li = loss_fn(ref(xi), yi)
            (li * (1.0 / M)).backward()
            rlosses.append(li.detach())
        ropt.step()
        torch.testing.assert_close(loss, torch.stack(rlosses).mean(), rtol=1e-6, atol=1e-7)
    mine = [p.detach() for st in pipe.stages for p in st.module.parameters()]
    theirs = [p.detach() for p in ref.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), max(
        float((a - b).abs().max()) for a, b in zip(mine, theirs, strict=True)
    )
    assert pipe.stats()["measured_delays"] == [{0: 3 * M}] * 4


def test_only_leaves_that_require_grad_carry_gradients(monkeypatch) -> None:
    """Integer ids and masks and the no-grad float bias travel without gradients: a stage's
    input leaves require grad exactly where the producer's output did, and its backward sends
    one gradient per such leaf (here only the hidden state's)."""
    from engine.runtime.stage.stage import Stage

    sent: dict[int, list[int]] = {}
    finish = Stage.finish_backward

    def record(self, job):
        out = finish(self, job)
        sent.setdefault(self.index, []).append(len(out) if isinstance(out, list) else -1)
        return out

    monkeypatch.setattr(Stage, "finish_backward", record)
    pipe = pipe_of("pb", chunks=2)  # asynchronous: one backward per stage and micro-batch
    pipe.step(*batch(0))
    entry = pipe.stages[1].stash.entries()[0]  # pb keeps micro-batches in flight
    h, mask, bias, ids = entry.x
    assert h.requires_grad and not mask.requires_grad and not bias.requires_grad
    assert not ids.requires_grad and ids.dtype == torch.int64 and bias.is_floating_point()
    pipe.flush()
    assert set(sent) == {0, 1, 2, 3}
    assert sent[0] == [-1] * 2  # stage 0 sends nothing upstream
    assert all(sent[s] == [1] * 2 for s in (1, 2, 3)), sent


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_with_trees(schedule: str) -> None:
    pipe = pipe_of(schedule, checkpoint="except_last")
    losses = [float(pipe.step(*batch(t))) for t in range(5)]
    pipe.flush()
    assert all(math.isfinite(v) for v in losses)
    stats = pipe.stats()
    for s, counts in enumerate(stats["measured_delays"]):
        assert max(counts) == pipe.delays[s] and sum(counts.values()) == 5 * 4
    assert pipe.flushed


# ---------------------------------------------------------------------- versions (the probe)


class ProbeStage(nn.Module):
    """(h, mask) in and out; the probe's weight is the stage's first parameter."""

    def __init__(self, s: int, last: bool) -> None:
        super().__init__()
        self.probe = Probe(3, init=1.0 + 0.1 * s)
        self.lin = nn.Linear(3, 1 if last else 3)
        self.last = last

    def forward(self, h, mask):
        y = self.lin(self.probe(h) * mask)
        return y if self.last else (torch.tanh(y), mask)


@pytest.mark.parametrize("schedule", VARIANTS)
def test_versions_with_tree_stages(schedule: str) -> None:
    order = None
    if schedule == "pb-1f1b":
        schedule, order = "pb", "1f1b"
    S, M = 3, 3
    torch.manual_seed(0)
    mods = [ProbeStage(s, s == S - 1) for s in range(S)]
    hist = History(S)
    pipe = Pipeline(
        mods, schedule=schedule, chunks=M, order=order, trace=True,
        loss_fn=nn.functional.mse_loss,
        optimizer=hist.factory(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        checkpoint="except_last",
    )
    g = torch.Generator().manual_seed(5)
    steps = 4
    for _ in range(steps):
        x = torch.randn(M, 3, generator=g)
        mask = (torch.rand(M, 3, generator=g) > 0.2).float()  # a float leaf that needs no grad
        pipe.step((x, mask), torch.randn(M, 1, generator=g))
    pipe.flush()
    check_versions(pipe, reads([m.probe for m in mods]), hist, steps * M, schedule, order)
    for s, counts in enumerate(pipe.stats()["measured_delays"]):
        assert max(counts) == pipe.delays[s]


# ---------------------------------------------------------------------- bad inputs


def test_a_leaf_with_another_batch_size_is_refused_naming_it() -> None:
    pipe = pipe_of("1f1b")
    pipe.step(*batch(0))
    before = snapshot(pipe)
    x, y = batch(1)
    x["mask"] = x["mask"][:7]
    with pytest.raises(PipelineInputError, match=r"inputs\['mask'\] has 7 samples on dim 0, inputs\['ids'\] has 8"):
        pipe.step(x, y)
    x, y = batch(1)
    y["weight"] = y["weight"][:6]
    with pytest.raises(PipelineInputError, match=r"targets\['weight'\] has 6 samples on dim 0, inputs\['ids'\] has 8"):
        pipe.step(x, y)
    x, y = batch(1)
    x["mask"] = torch.tensor(1)
    with pytest.raises(PipelineInputError, match=r"inputs\['mask'\] is a scalar tensor"):
        pipe.step(x, y)
    with pytest.raises(PipelineInputError, match="inputs hold no tensor"):
        pipe.step({"scale": 1.0}, y)
    assert same(before, snapshot(pipe)) and pipe.steps == 1


def test_a_non_tensor_leaf_is_passed_to_every_micro_batch_as_is() -> None:
    """A number that changes between calls reaches every micro-batch unchanged (the step
    equals the unpipelined model with that value) without re-running the dry run; a switch
    (bool, str, None) is part of the dry-run key."""
    pipe = pipe_of("gpipe", chunks=2)
    ref = Unpipelined(stages())
    ropt = sgd(ref.parameters())
    for t, scale in enumerate([1.0, 0.5, 0.5, 2.0]):
        x, y = batch(t, B=4, scale=scale)
        loss = pipe.step(x, y)
        ropt.zero_grad()
        rloss = loss_fn(ref(x), y)
        rloss.backward()
        ropt.step()
        torch.testing.assert_close(loss, rloss.detach(), rtol=1e-5, atol=1e-6)
    assert len(pipe._checked) == 1  # numbers are keyed by type only
    x, _ = batch(0)
    assert trees.key({**x, "causal": True}) != trees.key({**x, "causal": False})
    assert trees.key({**x, "scale": 2.0}) == trees.key(x)
    for a, b in zip((p for st in pipe.stages for p in st.module.parameters()), ref.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


class ReturnsSet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return {"h": self.lin(x), "seen": {1, 2}}


class ReturnsInt(nn.Module):
    def forward(self, x):
        return 3


class IntKeys(nn.Module):
    def forward(self, x):
        return {0: x}


@pytest.mark.parametrize(
    "first,match",
    [
        (ReturnsSet(), r"stage 0's output\['seen'\] is a set; a stage returns a tensor, or a tuple/list/dict"),
        (ReturnsInt(), r"stage 0 returned int; a stage returns a tensor"),
        (IntKeys(), r"stage 0 returned a dict with the key 0: .* keys must be strings"),
    ],
)
def test_a_stage_returning_something_else_is_refused(first: nn.Module, match: str) -> None:
    torch.manual_seed(0)
    pipe = Pipeline(
        [first, nn.Linear(D, 1)], schedule="1f1b", chunks=2,
        loss_fn=nn.functional.mse_loss, optimizer=sgd,
    )
    before = snapshot(pipe)
    with pytest.raises(PipelineInputError, match=match):
        pipe.step(torch.randn(4, D), torch.randn(4, 1))
    assert same(before, snapshot(pipe)) and pipe.steps == 0 and pipe.flushed


def test_the_wire_signature_names_what_changed() -> None:
    """Under gloo/NCCL each send is checked against the handshake's Signature: structure,
    constants, and every leaf's shape, dtype and requires_grad."""
    h = torch.zeros(2, 3, requires_grad=True)
    sig = trees.Signature.of({"h": h, "mask": torch.zeros(2, 3, dtype=torch.bool), "n": 2})
    assert [(p, m.requires_grad) for p, m in sig.metas(grad=False)] == [("['h']", True), ("['mask']", False)]
    assert [p for p, _ in sig.metas(grad=True)] == ["['h']"]
    ok = {"h": h, "mask": torch.ones(2, 3, dtype=torch.bool), "n": 2}
    assert sig.mismatch(ok) == ""
    assert "non-tensor leaf ['n'] is 3 instead of 2" in sig.mismatch({**ok, "n": 3})
    assert "['mask'] (3, 3) bool instead of (2, 3) bool" in sig.mismatch({**ok, "mask": torch.ones(3, 3, dtype=torch.bool)})
    assert "['h'] does not require grad" in sig.mismatch({**ok, "h": h.detach()})
    assert "instead of the agreed structure" in sig.mismatch((h, ok["mask"], 2))
    assert sig.grad_mismatch([torch.zeros(2, 3)]) == "" and "2 gradients instead of 1" in sig.grad_mismatch([h, h])
    from engine.runtime.ranks.transport.gloo import GlooTransport

    tp = GlooTransport(0, [0, 1], None, torch.device("cpu"), 5.0)
    tp._agree("act", "send", sig)
    with pytest.raises(ShapeAgreementError, match=r"stage 0 \(rank 0\) produced an activation for micro-batch 4 .* \['n'\] is 3 instead of 2"):
        tp.send("act", 0, 4, {**ok, "n": 3})


# ---------------------------------------------------------------------- gloo


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_gloo_trees_equal_local_bit_for_bit() -> None:
    results = spawn(2, [("trees", dict(S=2))], timeout=180)
    for rank, res in enumerate(results):
        assert "fatal" not in res, res.get("fatal")
        assert sorted(res["trees"]) == ["1f1b", "gpipe", "pb", "pb-nograd", "pipedream"]
        for name, r in res["trees"].items():
            assert "error" not in r, r.get("error")
            assert r["weights_equal"] and r["losses_equal"], (rank, name, r)
            assert r["shape_changes"] == 0, (rank, name, r)  # fixed shapes: no metadata
            assert r["updates"] == r["ref_updates"] > 0 and r["leftovers"] == 0, (rank, name, r)
    # the handshake agreed every leaf; only the hidden state carries a gradient back
    sig = results[0]["trees"]["gpipe"]["sent"]
    assert sig == [
        ("['h']", (2, 4, 6), torch.float32, True),
        ("['mask']", (2, 4), torch.bool, False),
        ("['ids']", (2, 4), torch.int64, False),
        ("['bias']", (2, 4), torch.float32, False),
    ], sig
    assert results[1]["trees"]["gpipe"]["grads_sent"] == ["['h']"]
    # a stage 0 whose output needs no gradient: none is sent back
    assert results[0]["trees"]["pb-nograd"]["sent"][0] == ("['h']", (2, 4, 6), torch.float32, False)
    assert results[1]["trees"]["pb-nograd"]["grads_sent"] == []


def test_tree_helpers_rebuild_containers() -> None:
    """The helpers rebuild containers (namedtuples and OrderedDicts included)."""
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    tree = OrderedDict(p=Pair(torch.ones(1), 3), q=[torch.zeros(2), None])
    leaves, spec = trees.flatten(tree)
    again = trees.unflatten(leaves, spec)
    assert type(again) is OrderedDict and type(again["p"]) is Pair and again["q"][1] is None
    assert [p for p, _ in trees.with_paths(tree, "x")] == ["x['p'][0]", "x['p'][1]", "x['q'][0]", "x['q'][1]"]
    assert trees.key(copy.deepcopy(tree)) == trees.key(tree)


def test_signature_allows_new_shapes_only() -> None:
    """A shape change travels as a new Signature; anything else stays an error."""
    h = torch.zeros(2, 3, 4, requires_grad=True)
    tree = {"h": h, "mask": torch.ones(2, 3, dtype=torch.bool), "n": 2}
    sig = trees.Signature.of(tree)
    longer = {"h": torch.zeros(2, 5, 4, requires_grad=True), "mask": torch.ones(2, 5, dtype=torch.bool), "n": 2}
    new = sig.reshaped(longer)
    assert new is not None and new.mismatch(longer) == ""
    assert sig.changes(new) == "['h'] (2, 3, 4) -> (2, 5, 4), ['mask'] (2, 3) -> (2, 5)"
    assert sig.reshaped({**longer, "n": 3}) is None  # constants are sent once
    assert sig.reshaped({**longer, "h": longer["h"].detach()}) is None  # requires_grad fixed
    assert sig.reshaped({**longer, "mask": longer["mask"].int()}) is None  # dtypes fixed
    assert sig.reshaped((longer["h"], longer["mask"])) is None  # structure fixed
    one = trees.Signature.of(h)
    assert one.reshaped(torch.zeros(7, 4, requires_grad=True)) is not None
    assert one.changes(one.reshaped(torch.zeros(7, 4, requires_grad=True))) == "the tensor (2, 3, 4) -> (7, 4)"
