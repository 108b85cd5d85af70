"""The runner of one rank: its lane of each compiled step program, sends and receives included.

Why a module: the step's rules are the protocol's (:mod:`~engine.runtime.exec.protocol`); a rank
differs only in where its actions run -- its own stage's list of each program (with virtual
stages, its stages' lists merged in the schedule's rank order), with blocking receives and
asynchronous sends through the point-to-point transport -- and in what it can decide alone.
A rank cannot stop between two actions by itself (its peers would wait for messages that
never come), so:

* a Ctrl-C is deferred to the end of the step (``stops_between_actions`` is False);
* in a synchronous gloo step of one replica, an exception raised inside the user's stage (or
  an abort frame received from a peer) does not stop the rank: it runs the rest of its lane's
  communication computing nothing, sending abort frames in place of what it owes
  (:mod:`~engine.runtime.ranks.transport.abort`). The step's verdict (:meth:`RankRuntime.relay_verdict`)
  then tells every rank, which all roll back; the failing rank raises the user's exception,
  the others :class:`~engine.errors.PeerStepError`;
* in an asynchronous gloo step the failing rank applies the local run's outcome to what its
  action touched, sends *dropped frames* in place of that micro-batch's messages (its peers
  drop it too and go on), finishes the step and raises the user's exception at its end;
* under NCCL (one replica, one stage per rank) nothing can be marked in band without a
  device synchronisation per message: the failing rank runs the rest of its lane's
  communication sending zeros of the agreed shapes (an input a stage refuses is handled
  alike), and the step's verdict on the control plane (:meth:`RankRuntime.nccl_verdict`)
  tells every rank. A synchronous step then rolls back on every rank, as under gloo; an
  asynchronous one cannot drop the micro-batch on the other ranks, which computed on the
  zeros: every rank raises at the step's end, saying so. Every message of the step was
  still sent and received, so no rank waits and no NCCL operation stays pending;
* elsewhere (data-parallel replicas, virtual stages) such an exception stops the rank
  (``RANK_STOPPED``).

Under NCCL a rank also receives, at the end of each asynchronous step, every message its
neighbours sent in the step that it has not received yet (engine/runtime/ranks/in_transit.py),
so no NCCL operation stays pending across a step boundary (transport/nccl.py says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from engine.errors import NonFiniteLossError, PeerError, PeerStepError, PipelineInputError
from engine.runtime.exec.failures import Outcome, discard_partial
from engine.runtime.ranks.first_failure import as_peer_error, begin, first, report
from engine.runtime.exec.program import OP_NAMES, RB, RF, SB, SF, B, F, StepProgram, U, W
from engine.runtime.exec.protocol import StepProtocol
from engine.runtime.exec.result import StepResult, _Input
from engine.runtime.stage.stage import DROPPED
from engine.runtime.ranks.in_transit import InTransit
from engine.runtime.ranks.transport.abort import Aborted, Dropped

__all__ = ["RankLane"]


class RankLane(InTransit):
    """The runner of one rank (module docstring): its lane of each compiled program, sends
    and receives included; what it computes it hands on through per-stage outboxes (and
    what is in transit at a step boundary: :class:`InTransit`)."""

    #: a rank that stopped between two actions would leave its peers waiting for messages
    stops_between_actions = False

    def __init__(self, p: StepProtocol, rank: Any, transports: dict[int, Any], lane: int) -> None:
        self.p = p
        self.rank = rank
        self.transport = rank.transport
        self.transports = transports  # stage -> its transport
        self.lane = lane  # index in StepProgram.lanes: the stage, or the rank
        self.stage = p.stages[0]
        self.s = self.stage.index
        self.pc = 0
        self.in_action = False
        #: per stage: ("act" | "grad", micro-batch) -> the tensor it sends at its SF/SB op
        self._outboxes: dict[int, dict[tuple[str, int], Any]] = {st.index: {} for st in p.stages}
        self._outbox = self._outboxes[self.s]  # the in-flight state's (one stage per rank)
        #: ("act" | "grad", micro-batch) -> a message received before its RF/RB op: at a save
        #: of the in-flight state (wire_state), or loaded with it
        self._early: dict[tuple[str, int], Any] = {}
        #: on_nonfinite="skip_update": (stage, micro-batch) -> the flag its SB op sends along
        self._out_flags: dict[tuple[int, int], Tensor] = {}
        #: a synchronous step may abort (RankExecutor): an exception of the user's stage, or
        #: an abort frame received, finishes the lane's communication with abort frames
        self.aborts = False
        #: an asynchronous step drops a micro-batch whose action raised, as locally, and
        #: tells its peers with dropped frames (gloo, one replica, one stage per rank)
        self.drops = False
        #: NCCL: an asynchronous step whose action raised completes its communication with
        #: zeros, and every rank raises at its end (module docstring)
        self.async_abort = False
        self.nccl = getattr(self.transport, "backend", None) == "nccl"
        #: this step's abort: the user's exception here, or the frame a peer sent
        self.failure: BaseException | None = None
        self.origin: BaseException | None = None  # the user's exception, once raised

    # ------------------------------------------------------------------ the protocol's calls

    def begin(self) -> None:
        self.rank.expect_loss()  # the step's loss message, posted before its work

    def feed(self, xs: list[Any], targets: list[Any], samples: list[int], base: int) -> None:
        p = self.p
        first, last = 0 in p.by_index, p.S - 1 in p.by_index
        if not (first or last):
            return
        readers = (1 if first else 0) + (1 if last else 0)
        for i, (x, t, b) in enumerate(zip(xs, targets, samples, strict=True)):
            p.inputs[base + i] = _Input(x, t, b, readers)

    def prepare_sync(self) -> None:
        """Each rank runs its own stage's backwards (no chaining across processes)."""

    def run(self, prog: StepProgram, start: int, base: int, updates: bool) -> None:
        self.failure = None
        k = start
        while True:
            try:
                self._rank_ops(prog, k, base, skip_updates=not updates)
                return
            except Exception as exc:  # (a second Ctrl-C, a BaseException, stops at once)
                if updates and self.async_abort and self._contained(exc):
                    self._abort_async(prog, base, exc)
                    return
                if not (updates and self.drops and self.in_action):
                    self._abort(prog, base, updates, exc)
                    return
                self._drop_failed(prog, base, exc)  # asynchronous: as locally, then go on
                self.failure = self.failure or exc  # (the first is raised at the step's end)
                k = self.pc + 1

    def _drop_failed(self, prog: StepProgram, base: int, exc: BaseException) -> None:
        """An exception inside this rank's action of an asynchronous step: drop what it
        touched, as the local run does (engine/runtime/exec/executor.py), sending dropped frames in
        place of the micro-batch's activation or gradient; the lane goes on."""
        p = self.p
        action = self.action(prog, self.pc)
        assert action is not None
        op, s, rel = action
        st = p.by_index[s]
        report(self.rank.layout.rank, exc)
        if op == U:
            p.note_outcome(exc, action, base, Outcome.UPDATE_SKIPPED)
            return
        i = base + rel
        p.dropped += 1
        if op == F:
            st.drop_forward(i, p.n_base + i, p.scale)
            self._outboxes[s].pop(("act", i), None)
            if not st.is_last:
                self._outboxes[s][("act", i)] = DROPPED
            p.note_outcome(exc, action, base, Outcome.DROPPED)
            return
        discard_partial(st, p.streams)
        if op == W:  # its input gradient already left: only the weight sums are lost
            p.note_outcome(exc, action, base, Outcome.WEIGHT_GRADIENT_FAILED)
            return
        if s > 0:
            self._outboxes[s][("grad", i)] = DROPPED
        p.note_outcome(exc, action, base, Outcome.BACKWARD_FAILED)

    def take_failure(self) -> BaseException | None:
        """The exception this rank's asynchronous step dropped a micro-batch for and went past:
        raised once the step (or flush) is complete."""
        exc, self.failure = self.failure, None
        return exc

    def _contained(self, exc: BaseException) -> bool:
        """Whether the lane finishes the step's communication after ``exc`` instead of
        stopping: the user's stage raised, an abort frame came, or (NCCL) this stage
        refused an input's shapes or produced shapes the notice did not announce."""
        return self.in_action or isinstance(exc, Aborted) or (
            self.nccl and isinstance(exc, PipelineInputError)
        )

    def _abort(self, prog: StepProgram, base: int, updates: bool, exc: Exception) -> None:
        """A synchronous step aborts (module docstring), or the exception propagates."""
        if not (self.aborts and not updates and self._contained(exc)):
            raise exc
        at, inside = self.pc, self.in_action
        self.failure = exc
        text = self._failure_text(exc)
        self._abort_ops(prog, self._resume_at(prog, at, exc), base, text)
        self.pc, self.in_action = at, inside

    def _abort_async(self, prog: StepProgram, base: int, exc: Exception) -> None:
        """NCCL, an asynchronous step: finish its communication with zeros (no update,
        nothing computed); the step's verdict makes every rank raise (module docstring)."""
        at, inside = self.pc, self.in_action
        self.failure = exc
        self._abort_ops(prog, self._resume_at(prog, at, exc), base, self._failure_text(exc))
        self.pc, self.in_action = at, inside

    def _failure_text(self, exc: BaseException) -> str:
        if isinstance(exc, Aborted):
            return str(exc)
        lay = self.rank.layout
        report(lay.rank, exc)  # the first failure's note, before any frame leaves
        return f"rank {lay.rank} ({self.transport.who(self.s)}): {type(exc).__name__}: {exc}"

    def _resume_at(self, prog: StepProgram, at: int, exc: BaseException) -> int:
        """Where the aborted lane's communication continues: after the failed op -- or at it
        when it is an NCCL send refused before anything was posted (its receiver still
        expects the message)."""
        if self.nccl and not self.in_action and isinstance(exc, PipelineInputError):
            s, pc = prog.lanes[self.lane][at]
            if prog.stages[s][pc][0] in (SF, SB):
                return at
        return at + 1

    def _abort_ops(self, prog: StepProgram, start: int, base: int, text: str) -> None:
        """The rest of the lane's communication, computing nothing: an abort frame in place of
        every message this rank owes, every message it expects received (and dropped)."""
        lane = prog.lanes[self.lane]
        for tp in self.transports.values():
            tp.aborting = True  # (NCCL: new shapes are taken without the acceptance check)
        try:
            self._abort_comm(prog, lane, start, base, text)
        finally:
            for tp in self.transports.values():
                tp.aborting = False

    def _abort_comm(self, prog: StepProgram, lane: Any, start: int, base: int, text: str) -> None:
        for k in range(start, len(lane)):
            s, pc = lane[k]
            op, rel = prog.stages[s][pc]
            if op not in (RF, RB, SF, SB):
                continue  # computing nothing
            i = base + rel
            tp = self.transports[s]
            if op in (RF, RB):
                channel = "act" if op == RF else "grad"
                if self._early.pop((channel, i), None) is None:
                    try:
                        tp.recv(channel, s, i, base + prog.certain[s][pc])
                    except Aborted:
                        pass
                    tp.arrived_flags.pop(i, None)
                got = prog.releases[s].get(pc) if op == RF else None
                if got:
                    tp.release("grad", [base + m for m in got])
            elif op in (SF, SB):
                channel = "act" if op == SF else "grad"
                self._outboxes[s].pop((channel, i), None)
                self._out_flags.pop((s, i), None)
                tp.send_abort(channel, s, i, text)

    def _raise_aborted(self) -> None:
        """Every rank agreed the step aborted: the rank whose stage raised raises the user's
        exception, every other rank a PeerStepError naming it (a synchronous step rolls back;
        an asynchronous one under NCCL cannot: the pipeline is closed on every rank, its
        further calls say so: module docstring)."""
        exc, self.failure = self.failure, None
        if not self.p.sync:
            self.rank.broken = (
                "this pipeline stopped: a stage raised inside an asynchronous step under "
                "transport='nccl', whose micro-batch could not be dropped on every rank, so "
                "the ranks' weights and micro-batches in flight no longer agree. Build the "
                "pipeline again and engine.load the last checkpoint." + first(self.rank.layout.rank)
            )
        if exc is not None and not isinstance(exc, Aborted):
            self.origin = exc
            raise exc
        lay = self.rank.layout
        said = f": {exc.text}" if isinstance(exc, Aborted) and exc.text else ""
        if not self.p.sync:
            raise PeerStepError(
                f"{self.transport.who(self.s)}: another rank's stage raised inside this "
                f"asynchronous step{said}. Under transport='nccl' its micro-batch could not be "
                "dropped on the other ranks (that needs a mark in every message, a device "
                "synchronisation each): this step's updates used zeros in its place. Restore "
                "the last checkpoint (engine.load) before going on." + first(lay.rank)
            )
        raise PeerStepError(
            f"{self.transport.who(self.s)}: another rank's stage raised inside this step{said}. "
            "Every rank rolled the step back (no weight, gradient, optimizer state, RNG state or "
            "module buffer changed); the same step can be retried." + first(lay.rank)
        )

    def action(self, prog: StepProgram, pc: int) -> tuple[int, int, Any] | None:
        lane = prog.lanes[self.lane]
        if pc >= len(lane):
            return None
        s, k = lane[pc]
        op, rel = prog.stages[s][k]
        return (op, s, rel) if op in (F, B, W, U) else None

    def failed(self, prog: StepProgram, base: int, exc: BaseException) -> None:
        """An exception inside this rank's forward, backward or weight gradient (the user's
        code): the rank stopped mid-step; its peers raise PeerError naming it."""
        self.p.note_outcome(exc, self.action(prog, self.pc), base, Outcome.RANK_STOPPED)

    def recoverable(self, exc: BaseException) -> bool:
        """What every rank raised together (a non-finite loss, an input a stage refused and
        passed on, an aborted step) is rolled back on every rank; anything else stopped this
        rank alone."""
        if exc is self.origin:
            self.origin = None
            return True
        return isinstance(exc, (NonFiniteLossError, PipelineInputError, PeerStepError))

    def share(self, result: StepResult) -> StepResult:
        """The last stage's loss and non-finite count, on every rank of the pipeline (every
        rank words its error alike: the count, not the last stage's ids); with abort frames,
        whether any rank aborted the step (then it raises here, on every rank). Under NCCL
        an asynchronous step first receives what is still in transit (module docstring)."""
        if self.nccl:
            if not self.p.sync:
                self._receive_in_transit()
            loss, nonfinite, aborted = self.rank.nccl_verdict(
                result.loss, result.nonfinite, self.failure is not None
            )
            if aborted:
                self._raise_aborted()
            return StepResult(loss, nonfinite, [])
        if self.rank.relay:
            loss, nonfinite, aborted = self.rank.relay_verdict(
                result.loss, result.nonfinite, self.failure is not None
            )
            if aborted:
                self._raise_aborted()
            if self.failure is not None:  # no frame reached the first stage (a late W): the
                exc, self.failure = self.failure, None  # peers committed; this rank stops
                raise exc
            return StepResult(loss, nonfinite, [])
        loss, nonfinite = self.rank.share_loss(result.loss, result.nonfinite)
        return StepResult(loss, nonfinite, [])

    def end_sync(self) -> None:
        self._wait_sends()  # an asynchronous step's last sends are received in the next step

    def end_drain(self) -> None:
        self._wait_sends()

    def clear(self) -> None:
        for box in self._outboxes.values():
            box.clear()
        self._out_flags.clear()

    @contextmanager
    def reported(self) -> Iterator[None]:
        """A flush: counted as a collective call, its failure named for the peers
        (:mod:`~engine.runtime.ranks.first_failure`)."""
        begin()
        if self.rank.broken:
            raise PeerError(self.rank.broken)
        try:
            yield
        except BaseException as exc:
            lay = self.rank.layout
            report(lay.rank, exc)
            peer = as_peer_error(exc, lay.rank, f"stage {self.s} (rank {lay.rank})")
            if peer is exc:
                raise
            raise peer from exc

    def _wait_sends(self) -> None:
        for tp in self.transports.values():
            tp.wait_sends()

    # ------------------------------------------------------------------ running

    def _rank_ops(self, prog: StepProgram, start: int, base: int, skip_updates: bool) -> None:
        p = self.p
        lane = prog.lanes[self.lane]
        by_index, tps, boxes = p.by_index, self.transports, self._outboxes
        hook = p.action_hook
        n_base = p.n_base
        for k in range(start, len(lane)):
            self.pc = k
            self.in_action = False
            s, pc = lane[k]
            op, rel = prog.stages[s][pc]
            st = by_index[s]
            if op == U:
                if not skip_updates:
                    if hook is not None:
                        hook(s, "U", n_base + base + rel[-1])
                    self.in_action = True
                    st.update()
                continue
            i = base + rel
            tp = tps[s]
            if op == RF:
                early = self._early.pop(("act", i), None) if self._early else None
                if early is None:
                    try:
                        early = tp.recv("act", s, i, base + prog.certain[s][pc])
                    except Dropped:  # (counted: dropped at this rank's stage too)
                        early = DROPPED
                        p.dropped += 1
                    except PipelineInputError:
                        if rel == 0:  # stopped before the step: this rank's later stages too
                            self.rank.pass_error(s, i)
                        raise
                p.acts[(s, i)] = (early, None)
                got = prog.releases[s].get(pc)
                if got:
                    tp.release("grad", [base + m for m in got])
            elif op == RB:
                if ("grad", i) in self._early:
                    p.grads[(s, i)] = (self._early.pop(("grad", i)), None)
                else:
                    try:
                        p.grads[(s, i)] = (tp.recv("grad", s, i, base + prog.certain[s][pc]), None)
                    except Dropped:
                        entry = st.stash.get(i)
                        p.dropped += entry is not None and not entry.dropped  # (new here)
                        p.grads[(s, i)] = (DROPPED, None)
                        continue
                    if p.flags is not None:
                        self._flag_arrived(st, tp, i)
                    if p.carry_scales:
                        self._scale_arrived(s, tp, i)
            elif op == SF:
                value = boxes[s].pop(("act", i))
                if value is DROPPED:
                    tp.send_abort("act", s, i, "", dropped=True)
                else:
                    tp.send("act", s, i, value)
            elif op == SB:
                value, flag = boxes[s].pop(("grad", i)), self._out_flags.pop((s, i), None)
                if value is DROPPED:
                    tp.send_abort("grad", s, i, "", dropped=True)
                elif p.carry_scales:  # (one P2PTransport per rank: asynchronous schedules)
                    tp.send("grad", s, i, value, flag, p.loss_scaler.carried.pop((s - 1, i), None))
                else:
                    tp.send("grad", s, i, value, flag)
            else:
                if hook is not None:
                    hook(s, OP_NAMES[op], n_base + i)
                self.in_action = True
                if op == F:
                    self._rank_forward(st, i)
                elif op == W:
                    st.backward_weight(i, n_base + i)
                else:
                    self._rank_backward(st, i)
        self.pc = len(lane)
        self.in_action = False

    def _rank_forward(self, st: Any, i: int) -> None:
        p = self.p
        s = st.index
        inp = p.take_input(i) if (s == 0 or st.is_last) else None
        x = inp.x if s == 0 else p.acts.pop((s, i))[0]  # type: ignore[union-attr]
        target = inp.target if (st.is_last and inp is not None) else None
        n = p.n_base + i
        out, loss = st.forward(i, n, x, target, p.scale)
        if not st.is_last:
            self._outboxes[s][("act", i)] = out
        elif loss is not None and inp is not None:
            p.losses.append((n, loss, inp.samples))
            if p.flags is not None:  # no host read: the flag travels with the gradients
                p.flags.mark(p.stages, i, loss)

    def _rank_backward(self, st: Any, i: int) -> None:
        p = self.p
        s = st.index
        grad = None
        if not st.is_last:
            grad, _ = p.grads.pop((s, i))
        entry = st.stash.get(i) if p.flags is not None else None
        gin = st.backward(i, p.n_base + i, grad)
        if entry is not None and entry.flag is not None and s > 0:
            self._out_flags[(s, i)] = entry.flag
        if s > 0:
            if gin is DROPPED and not self.drops:
                raise PipelineInputError(
                    f"stage {s} has no gradient to send back for micro-batch {p.n_base + i}: "
                    "it was dropped, which needs every stage in one process"
                )
            self._outboxes[s][("grad", i)] = gin  # None / []: no input leaf carries a gradient

    def _flag_arrived(self, st: Any, tp: Any, i: int) -> None:
        """The flag that came with micro-batch i's gradient joins its stash entry, whose
        backward adds it to the stage's found_inf ("skip_update")."""
        flag = tp.arrived_flags.pop(i, None)
        entry = st.stash.get(i)
        if flag is not None and entry is not None:
            entry.flag = flag.reshape(())

    def _scale_arrived(self, s: int, tp: Any, i: int) -> None:
        """Asynchronous float16: the loss scale micro-batch i's gradient was computed under
        waits for stage ``s``'s backward of it (engine/runtime/precision.py)."""
        c = tp.arrived_scales.pop(i, None)
        if c is not None:
            self.p.loss_scaler.carried[(s, i)] = c
