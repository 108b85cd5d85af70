"""What one rank of a multi-process pipeline does besides running its stage's actions.

``Pipeline(..., transport="gloo"|"nccl")`` keeps one stage per process (replica ``r // S``,
stage ``r % S``; see transport/layout.py). Around the executor this module adds:

* the first-step handshake: stage 0 dry-runs its module on micro-batch 0, announces its
  output's Signature (a tensor or a tree: every leaf's path, shape, dtype and requires_grad,
  and the constants; engine/runtime/stage/trees.py) to stage 1, which dry-runs on zeros of those
  shapes, and so on down the pipeline; the last stage checks ``loss_fn`` on the targets. The
  Signatures become the agreed channel contents (P2PTransport checks every later message
  against them). The dry runs record autograd (in eval mode) because requires_grad is part
  of the agreement: it says which leaves carry a gradient back. Every rank learns whether
  any rank failed, and all raise the same error naming both ranks, so none is left waiting.
* later shapes: tensor shapes may change between steps and micro-batches (the transport sends
  a new Signature only when they do). Each stage dry-runs its module once per new set of
  input shapes (:meth:`RankRuntime.accepts`; stage 0 on its micro-batches before the step,
  the others when a new Signature arrives) and raises a clear error, passed downstream,
  instead of failing inside a step.
* the loss: the last stage's mean loss is sent to every stage of its replica (tagged
  point-to-point messages on the pipeline's gloo group) and averaged over the replicas, so
  ``pipe.step`` returns the same value on every rank; a synchronous gloo step of one replica
  sends it through the first stage instead, with the step's verdict (whether a rank aborted
  it), which then travels down the pipeline stage by stage (:meth:`RankRuntime.relay_verdict`).
  Under NCCL every rank contributes its own verdict (a failure there is not visible in band)
  to one gloo all-reduce over the world's control group (:meth:`RankRuntime.nccl_verdict`);
* under NCCL, the per-step shape notice of the first stage (transport/shape_notice.py);
* the gradient all-reduce of data-parallel replicas (mean over replicas, one collective per
  dtype per update, on the stage's data-parallel group);
* automatic partitioning decided once, by global rank 0, and broadcast (profiled timings
  differ between processes, and all ranks must cut the model at the same layers).

Every wait has the pipeline's ``timeout``. Host messages travel on the control plane, gloo
under both transports (transport/control.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.errors import PipelineInputError
from engine.runtime.stage import trees
from engine.runtime.stage.inputs import describe, first_layer_expectation, one_dim_hint
from engine.runtime.ranks.transport.control import LOSS_TAG, world_group
from engine.runtime.ranks.transport.groups import GroupCalls
from engine.runtime.ranks.transport.layout import Layout
from engine.runtime.ranks.transport.p2p import P2PTransport
from engine.runtime.ranks.transport.shape_notice import ShapeNotices

__all__ = ["RankRuntime", "broadcast_balance", "LOSS_TAG"]


class RankRuntime:
    """The collectives and the handshake of one rank (see the module docstring)."""

    def __init__(
        self, layout: Layout, transport: P2PTransport, timeout: float, first_index: int = 0,
        chunks: int = 1,
    ) -> None:
        self.layout = layout
        self.transport = transport
        self.timeout = timeout
        #: NCCL: host messages on the pipeline's gloo control group, the step's verdict by
        #: one all-reduce, shape notices before each step
        self.nccl = transport.backend == "nccl"
        self.handshaken = False
        self._loss_work: Any = None
        self._loss_msg = torch.zeros(4, dtype=torch.float64)
        #: gloo: the loss message's receive buffers, one per step parity -- a relaying rank
        #: sends on what it received while the next step's receive fills the other one (that
        #: send is waited for before its buffer is posted again)
        self._loss_bufs = (self._loss_msg, torch.zeros(4, dtype=torch.float64))
        self._loss_sends: list[Any] = []
        #: the loss messages' calls on the pipeline group: the transport's when it talks on
        #: that group (then shared memory between neighbours on one host: transport/shm.py)
        calls = getattr(transport, "calls", None)
        same = calls is not None and getattr(transport, "group", None) is layout.pipeline_group
        if self.nccl:
            self._calls = GroupCalls(layout.control_group)
        else:
            self._calls = calls if same else GroupCalls(layout.pipeline_group)
        #: NCCL: which micro-batches' activations travel with a header (shape_notice.py)
        self.notices: ShapeNotices | None = None
        #: why this rank's pipeline cannot go on (an asynchronous NCCL step a stage raised
        #: in: lane.py); every later step, flush and save raises it
        self.broken: str | None = None
        if self.nccl:
            ranks = list(layout.pipeline_ranks)
            self.notices = ShapeNotices(
                self._calls, ranks, ranks[first_index], layout.rank, chunks, self._wait_host
            )
        #: synchronous gloo steps of one replica: the step's verdict (loss, non-finite count,
        #: whether a rank aborted) comes from the first stage, which every abort frame reaches
        #: (:meth:`relay_verdict`); set by the rank's executor
        self.relay = False
        # the input shapes this stage's module was seen to accept (one dry run each)
        self._accepted: set[tuple[tuple[int, ...], ...]] = set()
        self._first_in: trees.Signature | None = None  # the handshake's input shapes

    @property
    def device(self) -> torch.device:
        return self.transport.device

    def _wait_host(self, work: Any, what: str, peer: int | None = None) -> None:
        """A control-plane (gloo) work, waited for on the host with the pipeline's timeout."""
        getattr(self.transport, "wait_host", self.transport.wait)(work, what, peer)

    # ------------------------------------------------------------------ handshake

    def handshake(
        self,
        module: nn.Module,
        x0: Any,
        target0: Any,
        loss_fn: Callable[[Tensor, Any], Tensor] | None,
    ) -> None:
        """Agree the activation Signatures stage by stage; raise the same error on every rank."""
        problem, inp = self.exchange_signatures(module, x0, target0, loss_fn)
        self.agree_handshake([problem])
        self.accept_shapes(module, inp)

    def exchange_signatures(
        self,
        module: nn.Module,
        x0: Any,
        target0: Any,
        loss_fn: Callable[[Tensor, Any], Tensor] | None,
    ) -> tuple[str, Any]:
        """This stage's part of the handshake: receive the previous stage's Signature, dry-run
        on zeros of its shapes, announce the output's. Returns (problem or "upstream" or "",
        the input the dry run used)."""
        lay, tp = self.layout, self.transport
        s, S = lay.stage, lay.stages
        problem = ""
        inp: Any = None
        if s == 0:
            inp = x0.detach() if isinstance(x0, Tensor) else trees.map_tensors(Tensor.detach, x0)
        else:
            sig = tp.recv_meta("act")
            if sig is None:
                problem = "upstream"
            else:
                # zeros of the agreed shapes, requiring grad where the producer's leaf does
                inp = sig.build(
                    [torch.zeros(m.shape, dtype=m.dtype, device=self.device) for _, m in sig.metas(False)]
                )
        out: Any = None
        if not problem and inp is not None:
            out, problem = self._dry_run(module, inp, target0 if s == S - 1 else None, loss_fn)
        if s < S - 1:
            if not problem and out is not None:
                problem = tp.unsupported(out)
            tp.send_meta("act", out if not problem else None)
        return problem, inp

    def agree_handshake(self, problems: list[str]) -> None:
        """Every rank of the pipeline learns whether any of its stages failed the handshake
        (``problems``: this rank's, "upstream" for a stage whose predecessor failed) and all
        raise the failing stage's error."""
        lay = self.layout
        real = [p for p in problems if p and p != "upstream"]
        code = 1 if real else (2 if any(problems) else 0)
        codes = torch.tensor([code])
        group = lay.control_group
        self._wait_host(
            dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group, async_op=True),
            "agreeing the handshake",
        )
        if int(codes.item()) == 0:
            self.handshaken = True
            return
        messages: list[Any] = [None] * lay.stages
        dist.all_gather_object(messages, real[0] if real else "", group=group)
        first = next(m for m in messages if m)
        raise PipelineInputError(f"handshake failed, no weight changed: {first}")

    def accept_shapes(self, module: nn.Module, inp: Any) -> None:
        """After an agreed handshake: the input shapes this stage was seen to accept, and the
        transport's check of later shape changes."""
        self.handshaken = True
        if inp is not None:
            self._first_in = trees.Signature.of(inp)
            self._accepted.add(_shapes(self._first_in))
        self.transport.accept = lambda old, new, mb: self.accepts(module, old, new, mb)

    def accepts(
        self, module: nn.Module, old: trees.Signature, new: trees.Signature, mb: int
    ) -> str:
        """Why this stage's module cannot take inputs of ``new``'s shapes ("" when it can);
        one dry run per new set of shapes (no weight, mode or RNG state changes)."""
        key = _shapes(new)
        if key in self._accepted:
            return ""
        zeros = [torch.zeros(m.shape, dtype=m.dtype, device=self.device) for _, m in new.metas(False)]
        _, problem = self._dry_run(module, new.build(zeros), None, None)
        if problem:
            s = self.layout.stage
            src = "its input micro-batch" if s == 0 else f"the output of {self.transport.who(s - 1)}"
            return (
                f"the shape of {src} changed at micro-batch {mb} ({old.changes(new)}) and "
                f"{self.transport.who(s)} cannot accept it (micro-batch {mb} did not run). "
                f"{problem}"
            )
        self._accepted.add(key)
        return ""

    def check_inputs(self, module: nn.Module, xs: list[Any], base: int) -> None:
        """Stage 0, before a step: dry-run the module on micro-batch shapes not seen yet; on
        failure tell the later stages (in place of the step's first activation) and raise."""
        for i, x in enumerate(xs):
            if isinstance(x, Tensor) and (tuple(x.shape),) in self._accepted:
                continue  # (the key _shapes gives a one-tensor Signature, without building it)
            sig = trees.Signature.of(x)
            if _shapes(sig) in self._accepted:
                continue
            problem = self.accepts(module, self._first_in or sig, sig, base + i)
            if problem:
                self.transport.poison(problem)
                raise PipelineInputError(problem)

    def _dry_run(
        self,
        module: nn.Module,
        inp: Any,
        target: Any,
        loss_fn: Callable[[Tensor, Any], Tensor] | None,
    ) -> tuple[Any, str]:
        """Run the stage in eval mode on ``inp`` (RNG and modes restored); autograd records,
        so that the output says which leaves require grad."""
        lay, tp = self.layout, self.transport
        s = lay.stage
        modes = [m.training for m in module.modules()]
        rng = torch.get_rng_state()
        try:
            module.eval()
            with torch.enable_grad():
                try:
                    out = module(inp) if isinstance(inp, Tensor) else trees.call(module, inp)
                except Exception as exc:  # a wiring error: teach the fix, naming both ranks
                    if s == 0:
                        return None, (
                            f"{tp.who(0)} ({describe(module)}) cannot run on an input micro-batch "
                            f"of shape {trees.describe(inp)}{first_layer_expectation(module)}: {exc}"
                            f"{one_dim_hint(inp)}"
                        )
                    return None, (
                        f"{tp.who(s - 1)} outputs shape {trees.describe(inp)} but {tp.who(s)} "
                        f"({describe(module)}) cannot take it as input"
                        f"{first_layer_expectation(module)}: {exc}. Make stage {s - 1}'s output "
                        f"match stage {s}'s input (layer sizes or balance)."
                    )
                if s < lay.stages - 1:
                    problem = trees.check_output(out, tp.who(s))
                    if problem:
                        return None, problem
                if s == lay.stages - 1 and loss_fn is not None:
                    try:
                        loss = loss_fn(out, target)
                    except Exception as exc:
                        return None, (
                            f"loss_fn on {tp.who(s)} cannot compare the output of shape "
                            f"{trees.describe(out)} with targets {_words(target)}: {exc}"
                        )
                    if not isinstance(loss, Tensor) or loss.numel() != 1:
                        return (
                            None,
                            "loss_fn must return a scalar tensor (the mean over the micro-batch)",
                        )
                return out, ""
        finally:
            for m, mode in zip(module.modules(), modes, strict=False):
                m.training = mode
            torch.set_rng_state(rng)

    def settle_for_exit(self) -> None:
        """At interpreter exit (transport/teardown.py): the last step's loss messages and
        receive, then every transport of this rank."""
        from engine.runtime.ranks.transport.teardown import settle

        settle([work for work, _out in self._loss_sends])
        self._loss_sends = []
        if self.notices is not None:
            settle(self.notices.settle())
        self._loss_work = None  # (a receive: ends with the group)
        for tp in {id(t): t for t in getattr(self, "transports", {0: self.transport}).values()}.values():
            for side in getattr(tp, "sides", [tp]):
                side.settle_for_exit()
                side.group = None  # see release_groups
        self.release_groups()

    def release_groups(self) -> None:
        """Drop this rank's references to its process groups (at exit, after settling).

        Why: ``destroy_process_group`` only forgets torch's own references; a ``ProcessGroup``
        that the layout or a transport still holds stays alive with its gloo threads (two
        work loops, the TCP transport's loop, rank 0's store daemon) and is destroyed later,
        by the interpreter's finalization or never (seen: every one of those threads still ran
        after the teardown). Dropped here, the group dies inside ``destroy_process_group``,
        on the main thread, while the interpreter is whole."""
        self._calls.forget()
        lay = self.layout
        for name in ("pipeline_group", "dp_group", "control_group"):
            if getattr(lay, name, None) is not None:
                object.__setattr__(lay, name, None)  # frozen dataclass; the groups are gone
        if lay.channel_groups:
            lay.channel_groups.clear()

    # ------------------------------------------------------------------ loss

    def expect_loss(self, verdict: bool = False) -> None:
        """Post this step's receive of the loss message before the step's work (gloo).

        Why not a broadcast: a collective at the end of every step makes all ranks meet
        (milliseconds a step where ranks share cores, docs/design-notes.md). A receive posted up front costs
        nothing while the step runs, and the first stage, which finishes last in most
        schedules, finds the message already there. Loss messages use their own tag, so they
        never match the gradients the last stage sends on the same pair of ranks.
        """
        lay, tp = self.layout, self.transport
        if tp.backend != "gloo" or self._loss_work is not None:
            return
        first = lay.pipeline_ranks[0]
        if lay.holds_last and (not self.relay or not verdict):
            return  # (the last stage posts its verdict's receive when it has sent its loss)
        if self.relay:  # the first stage hears from the last, every other from the one before
            src = lay.last_rank if lay.rank == first else lay.pipeline_ranks[lay.stage - 1]
        else:
            src = lay.last_rank
        buf = self._loss_bufs[self._loss_msg is self._loss_bufs[0]]  # (the other one)
        pending = []
        for work, out in self._loss_sends:
            if out is buf:  # relayed two steps ago: waited for here, once (gloo's wait is not
                tp.wait(work, "sending the previous step's verdict")  # idempotent)
            else:
                pending.append((work, out))
        self._loss_sends = pending
        self._loss_msg = buf
        self._loss_work = self._calls.recv(buf, src, LOSS_TAG)

    def relay_verdict(
        self, loss: Tensor | None, nonfinite: int, aborted: bool
    ) -> tuple[Tensor | None, int, bool]:
        """:meth:`share_loss` of a synchronous gloo step with abort frames (engine/runtime/
        ranks/lane.py): the last stage sends (loss, non-finite count, its own abort) to the
        first, which adds what it learned (every abort frame of a synchronous step reaches it:
        the micro-batch that failed still owes it a gradient) and sends the verdict down the
        pipeline: each stage forwards it to the next as soon as it has it. Returns (loss or
        None, non-finite micro-batches, whether the step aborted).

        Why a chain and not the first stage sending to every stage: the first stage finishes
        the step last (its update and next forward are the critical path), and every message
        it sends costs it a gloo post; down the chain a stage forwards while it waits for the
        next step's first activation, which comes after the verdict anyway. The same number of
        messages; measured against the star on the shared 2-core machine, not distinguishable
        from noise (bench/README.md, "The step boundary")."""
        if self.nccl:
            return self.nccl_verdict(loss, nonfinite, aborted)
        lay, tp = self.layout, self.transport
        first = lay.pipeline_ranks[0]
        for work, _out in self._loss_sends:  # the previous step's: received long ago
            tp.wait(work, "sending the previous step's verdict")
        self._loss_sends = []
        if lay.holds_last:
            msg = _verdict(loss, nonfinite, aborted)
            self._loss_sends.append((self._calls.send(msg, first, LOSS_TAG), msg))
        self.expect_loss(verdict=True)  # no-op when posted at the start of the step
        work, self._loss_work = self._loss_work, None
        who = lay.stages - 1 if lay.rank == first else lay.stage - 1
        tp.wait(work, "receiving the step's verdict", who)
        got = self._loss_msg
        # one host read of the four numbers (each .item() is a dispatcher round trip)
        value, count, has_loss, verdict = got.tolist()
        if lay.rank == first and aborted and not verdict:
            got[3] = verdict = 1.0
        if lay.stage + 1 < len(lay.pipeline_ranks):  # on down the chain, the buffer itself
            nxt = lay.pipeline_ranks[lay.stage + 1]
            self._loss_sends.append((self._calls.send(got, nxt, LOSS_TAG), got))
        count, aborted_any = int(count), bool(verdict)
        if has_loss < 0.5:
            return None, count, aborted_any
        if lay.holds_last and loss is not None:
            return loss, count, aborted_any  # the very tensor the local run returns
        return torch.tensor(value, dtype=torch.float32), count, aborted_any

    def share_loss(self, loss: Tensor | None, nonfinite: int) -> tuple[Tensor | None, int]:
        """Send the last stage's (loss, non-finite count) to every stage of its replica, then
        average the loss over replicas. Returns (loss or None, non-finite micro-batches)."""
        if self.nccl:
            got, count, _ = self.nccl_verdict(loss, nonfinite, False)
            return got, count
        lay, tp = self.layout, self.transport
        last = lay.holds_last
        msg = _verdict(loss, nonfinite, False) if last else torch.zeros(4, dtype=torch.float64)
        if last:
            # the previous step's loss messages have arrived: every rank finished that step
            # (it waits for the loss) before its forwards of this step, which reached this
            # rank. Waiting returns at once; gloo's is_completed() cannot tell (it stays
            # False until wait()), so without it the list grew by S-1 works every step.
            for work, _out in self._loss_sends:
                tp.wait(work, "sending the previous step's loss")
            self._loss_sends = []
            for peer in (r for r in lay.pipeline_ranks if r != lay.last_rank):
                out = msg.clone()  # msg is all-reduced below while this may still be sent
                work = self._calls.send(out, peer, LOSS_TAG)
                self._loss_sends.append((work, out))
        else:
            self.expect_loss()  # no-op when posted at the start of the step
            work, self._loss_work = self._loss_work, None
            tp.wait(work, "receiving the step's loss", lay.stages - 1)
            msg = self._loss_msg
        if lay.replicas > 1:
            tp.wait(
                dist.all_reduce(msg, group=lay.dp_group, async_op=True),
                "averaging the loss over data-parallel replicas",
            )
            msg[0] /= lay.replicas
            msg[2] /= lay.replicas
        value, count, has_loss, _ = msg.tolist()  # one host read
        if has_loss < 0.5:
            return None, int(count)
        if last and lay.replicas == 1 and loss is not None:
            return loss, int(count)  # the very tensor the local run returns
        return torch.tensor(value, dtype=torch.float32, device=self.device), int(count)

    def nccl_verdict(
        self, loss: Tensor | None, nonfinite: int, failed: bool
    ) -> tuple[Tensor | None, int, bool]:
        """The step's end under NCCL: one gloo all-reduce over the world's control group of
        (loss, non-finite count, has a loss, failed) -- the loss and the count from each
        replica's last stage (its first tensor-parallel rank), a failure from every rank.

        Why every rank, and the world: under NCCL a failure is not visible in band (reading a
        mark would be a device synchronisation per message, transport/nccl.py), and the
        replicas of a synchronous step must commit or roll back together. The last stage
        reads its loss on the host here, once per step, as the local run does. Returns (the
        loss averaged over replicas or None, non-finite micro-batches, whether any rank
        failed)."""
        lay = self.layout
        speaks = lay.holds_last and getattr(lay, "tp_rank", 0) == 0 and loss is not None
        msg = torch.tensor(
            [float(loss.double()) if speaks else 0.0,  # type: ignore[union-attr]
             float(nonfinite) if lay.holds_last and getattr(lay, "tp_rank", 0) == 0 else 0.0,
             1.0 if speaks else 0.0, 1.0 if failed else 0.0],
            dtype=torch.float64,
        )
        self._wait_host(
            dist.all_reduce(msg, group=world_group(self.timeout), async_op=True),
            "agreeing the step's verdict",
        )
        value, count, has_loss, bad = msg.tolist()  # one host read
        if has_loss < 0.5:
            return None, int(count), bad > 0
        if speaks and lay.replicas == 1:
            return loss, int(count), bad > 0  # the very tensor the local run returns
        value = value / lay.replicas
        return torch.tensor(value, dtype=torch.float32, device=self.device), int(count), bad > 0

    def pass_error(self, stage: int, mb: int) -> None:
        """After ``stage`` received an earlier stage's error in place of micro-batch ``mb``'s
        activation (and passed it on): nothing more to do with one stage per rank."""

    # ------------------------------------------------------------------ data parallel

    def reduce_gradients(self, flats: list[Tensor]) -> None:
        """Mean of the stage's flat gradient buffers over its replicas: one all-reduce per
        buffer, in place (no flatten/unflatten copies). Every replica runs the same model, so
        they agree on the buffers and on which parameters received gradients."""
        lay = self.layout
        if lay.replicas == 1:
            return
        for flat in flats:
            self.transport.wait(
                dist.all_reduce(flat, group=lay.dp_group, async_op=True),
                f"all-reducing stage {lay.stage}'s gradients over {lay.replicas} replicas",
            )
            flat.div_(lay.replicas)


def _verdict(loss: Tensor | None, nonfinite: int, aborted: bool) -> Tensor:
    """The loss message: (loss or nan, non-finite count, whether there is a loss, aborted),
    float64, built in one op."""
    value = float("nan") if loss is None else float(loss.double())
    return torch.tensor(
        [value, float(nonfinite), 0.0 if loss is None else 1.0, float(aborted)], dtype=torch.float64
    )


def _shapes(sig: trees.Signature) -> tuple[tuple[int, ...], ...]:
    return tuple(m.shape for _, m in sig.metas(False))


def _words(target: Any) -> str:
    if isinstance(target, (Tensor, tuple, list, dict)):
        return trees.describe(target)
    return repr(target)


def broadcast_balance(compute: Callable[[], list[int]], timeout: float) -> list[int]:
    """Global rank 0 partitions (``compute()``), every rank receives the same layer counts.

    Why rank 0 decides: ``balance="time"`` profiles wall time, which differs between processes;
    cutting the model at different layers on different ranks would wire the wrong stages
    together. Failures on rank 0 are sent as the error text so every rank raises it.
    """
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", list(compute()))
        except Exception as exc:  # forwarded to every rank below, then raised there
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0, group=world_group(timeout))  # host objects: gloo
    kind, value = box[0]
    if kind == "error":
        raise ValueError(f"rank 0 could not partition the model: {value}")
    return list(value)
