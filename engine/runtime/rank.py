"""One stage per process (gloo/NCCL): building a rank's stage and running its step programs.

Why a module of its own: under ``torchrun`` a process builds only its own stage (from a
factory, so no process materialises the whole model), runs only its stage's list of each
compiled step program -- sends and receives through the blocking point-to-point transport --
and meets the other ranks for three things (:mod:`engine.runtime.distributed`): the shape
handshake at the first step, the step's loss (sent by the last stage to every rank of its
replica), and the data-parallel all-reduce of the flat gradient buffers.

A synchronous step runs the stage's forwards, backwards and communication, then the loss
check (on every rank, from the shared loss message), then its update; an asynchronous step
runs the whole list. The weights after any number of steps equal the local run's bit for bit
on CPU: every rank executes exactly its stage's actions of the same compiled programs.
With virtual stages (interleaved 1F1B) a rank builds and runs its v stages, their actions
merged in the schedule's rank order (:mod:`engine.runtime.virtual`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.errors import NonFiniteLossError, PipelineConfigError, PipelineInputError
from engine.runtime import trees
from engine.runtime.build import build_module, build_store, resolve_stage_specs
from engine.runtime.executor import Executor, StepResult
from engine.runtime.failures import nonfinite_message
from engine.runtime.first_failure import as_peer_error, begin, report
from engine.runtime.placement import RankPlacement
from engine.runtime.rank_guard import interrupt_at_step_end, note_stopped, restore, rollback_point
from engine.runtime.program import OP_NAMES, RB, RF, SB, SF, F, StepProgram, U, W
from engine.runtime.stage import DROPPED
from engine.runtime.streams import StageStreams

if TYPE_CHECKING:
    from engine.runtime.pipeline import Pipeline

__all__ = ["build_distributed", "RankExecutor"]


def build_distributed(
    pipe: Pipeline,
    stages: Any,
    schedule: Any,
    chunks: int | None,
    loss_fn: Callable[[Tensor, Any], Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    update_size: int | None,
    order: str | None,
    balance: Any,
    weight_prediction: str | None,
    discrepancy_correction: bool | None,
    lr_scheduler: Any,
    num_stages: int | None,
    sample: Tensor | None,
    memory_cap_bytes: float | None,
    deferred_batch_norm: bool = False,
    balance_repeats: int = 3,
    balance_profile: Any = None,
    tied: Any = None,
) -> None:
    """The distributed half of ``Pipeline.__init__`` (``tied``: its ``ties`` argument)."""
    from engine.runtime.distributed import RankRuntime, broadcast_balance
    from engine.runtime.transport.layout import init_distributed, make_layout
    from engine.runtime.transport.p2p import P2PTransport

    cfg = pipe.config
    try:
        init_distributed(cfg.transport, cfg.timeout)
    except ValueError as exc:
        raise PipelineConfigError(str(exc)) from None
    if isinstance(balance, str):
        from engine.runtime.balance import auto_balance

        args = (stages, balance, schedule, chunks, order, num_stages, sample, memory_cap_bytes)
        extra = dict(repeats=balance_repeats, profile=balance_profile)
        try:
            balance = broadcast_balance(lambda: auto_balance(*args, **extra), cfg.timeout)
        except ValueError as exc:
            raise PipelineConfigError(str(exc)) from exc
    specs = resolve_stage_specs(stages, balance)
    pipe.balance = list(balance) if balance is not None else None
    spec = pipe._resolve(schedule, len(specs), chunks, update_size, order)
    virtual = spec.program is not None and spec.program.rank_order is not None
    ranks = spec.stages
    if virtual:  # v stages per rank (engine/runtime/virtual.py)
        from engine.runtime.virtual import check_virtual

        ranks = check_virtual(spec, cfg.data_parallel)
    try:
        layout = make_layout(ranks, cfg.data_parallel)
    except ValueError as exc:
        per = f" (interleaved: the {spec.stages} virtual stages run on {ranks} ranks)" if virtual else ""
        raise PipelineConfigError(f"{exc}{per}") from None
    place = RankPlacement.of(spec)  # round-robin, the V, or any map (engine/runtime/placement.py)
    layout = dataclasses.replace(layout, last_index=place.last)
    mine = place.held(layout.stage)
    modules = [build_module(specs[s], s) for s in mine]
    if deferred_batch_norm:
        from engine.runtime.batch_norm import convert_deferred_batch_norm

        modules = [convert_deferred_batch_norm(m, spec.chunks) for m in modules]
    device = torch.device("cpu")
    for s, module in zip(mine, modules, strict=True):
        if cfg.transport == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            module.to(device)
        elif any(p.is_cuda for p in module.parameters()):
            raise PipelineConfigError(
                f"stage {s} has CUDA parameters but transport='gloo' carries CPU tensors; "
                "use transport='nccl' (one GPU per rank) or keep the model on CPU"
            )
    from engine.runtime.ties import broadcast_owner, connect_ties, tie_stages, with_declared

    ties: list[Any] = []
    if all(isinstance(m, nn.Module) for m in specs):  # factories: only declared ties
        ties = tie_stages(list(specs), spec, stages=mine)
    here = dict(zip(mine, modules, strict=True))
    ties, declared, tie_shapes = with_declared(ties, tied, spec, here)
    connect_ties(ties, ranks, cfg.data_parallel, layout.stage, layout.replica, place.rank_of)
    built = [
        build_store(m, s, optimizer, pipe.config.cuda_graphs)
        for s, m in zip(mine, modules, strict=True)
    ]
    from engine.runtime.agreement import agree, fingerprint

    bridge = built[0][1]
    options = dict(
        weight_prediction=weight_prediction,
        discrepancy_correction=discrepancy_correction,
        deferred_batch_norm=deferred_batch_norm,
        **pipe.features.describe(),
        **tie_shapes,  # compared among the ranks holding each declared tie
    )
    held = modules[0] if not virtual else nn.ModuleList(modules)
    fp = fingerprint(spec, cfg, options, ties, bridge.opt if bridge is not None else None, held)
    agree(fp, layout.rank, ranks, device)
    broadcast_owner(declared, here, lambda s: layout.replica * ranks + place.rank_of(s))
    pipe.device = device
    pipe.layout = layout
    if virtual:
        from engine.runtime.virtual import VirtualRankRuntime, virtual_transports

        tps = virtual_transports(cfg.transport, layout, spec.stages, device, cfg.timeout, place)
        pipe._rank = VirtualRankRuntime(layout, tps, cfg.timeout)
    else:
        tp = P2PTransport(
            cfg.transport, mine[0], list(layout.pipeline_ranks), layout.pipeline_group, device,
            cfg.timeout,
        )
        pipe._rank = RankRuntime(layout, tp, cfg.timeout)
        tps = {mine[0]: tp}
    from engine.runtime.transport.teardown import track

    track(pipe._rank)  # its pending communication is settled at exit, before finalization
    streams = StageStreams(mine, None)
    pipe._finish(
        spec, modules, built, mine, loss_fn, weight_prediction, discrepancy_correction,
        lr_scheduler, streams=streams,
    )
    device_flags = pipe._executor.flags is not None  # (the local executor, replaced below)
    for st in pipe.stages:  # (a virtual stage's runtime names it in errors)
        reduce = (pipe._rank.per_stage[st.index] if virtual else pipe._rank).reduce_gradients
        skip = st.bridge.skip if st.bridge is not None else None
        if skip is not None:  # one replica's flag skips the update on every replica
            reduce = _with_flag(reduce, skip.found_inf)
        st.grad_hook = reduce
    if device_flags:
        for tp in tps.values():
            tp.flags = True  # gradients carry their micro-batch's non-finite flag
    if virtual:
        pipe._rank.stages = [(st.index, st.module, st.loss_fn) for st in pipe.stages]
    pipe._executor = RankExecutor(
        spec, pipe.stages, on_nonfinite=cfg.on_nonfinite, streams=streams, rank=pipe._rank,
        transports=tps, lane=layout.stage if virtual else mine[0], device_flags=device_flags,
    )
    pipe.ties = ties
    if ties:
        from engine.runtime.ties import TiedGradients

        pipe._executor.ties = TiedGradients(ties, pipe.stages)
    pipe.replicas = cfg.data_parallel
    from engine.runtime.step_features import attach

    attach(pipe, layout.pipeline_group)  # clipping, mixed precision, offload


def _with_flag(reduce: Callable[[list[Tensor]], None], found_inf: Tensor) -> Callable[[list[Tensor]], None]:
    """The data-parallel gradient mean, with the stage's found_inf accumulator averaged along
    (non-zero on every replica when it is on any: they skip the same updates)."""
    return lambda flats: reduce([*flats, found_inf])


class RankExecutor(Executor):
    """The executor of one rank: its stage's op list with blocking communication (with
    virtual stages: its stages' lists merged in the schedule's rank order, ``lane``)."""

    def __init__(
        self, *args: Any, rank: Any, transports: dict[int, Any], lane: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.transport = rank.transport
        self.transports = transports  # stage -> its transport
        self.lane = lane  # index in StepProgram.lanes: the stage, or the rank
        self.stage = self.stages[0]
        self.s = self.stage.index
        self.immediate_nonfinite = False  # checked once per step, on every rank
        self.chain_sync = False
        #: per stage: ("act" | "grad", micro-batch) -> the tensor it sends at its SF/SB op
        self._outboxes: dict[int, dict[tuple[str, int], Any]] = {st.index: {} for st in self.stages}
        self._outbox = self._outboxes[self.s]  # the in-flight state's (one stage per rank)
        #: ("act" | "grad", micro-batch) -> a message received before its RF/RB op: at a save
        #: of the in-flight state (wire_state), or loaded with it
        self._early: dict[tuple[str, int], Any] = {}
        #: on_nonfinite="skip_update": (stage, micro-batch) -> the flag its SB op sends along
        self._out_flags: dict[tuple[int, int], Tensor] = {}
        #: asynchronous float16: gradients carry their loss scale (runtime/amp.py; set by attach)
        self.carry_scales = False

    # ------------------------------------------------------------------ running

    def _ops(self, prog: StepProgram, start: int, base: int, skip_updates: bool) -> None:
        try:
            self._rank_ops(prog, start, base, skip_updates)
        except BaseException as exc:
            note_stopped(self, exc, prog, base)  # (the user's forward/backward: rank_guard.py)
            raise
        finally:
            for st in self.stages:
                st.settle()

    def _rank_ops(self, prog: StepProgram, start: int, base: int, skip_updates: bool) -> None:
        lane = prog.lanes[self.lane]
        by_index, tps, boxes = self.by_index, self.transports, self._outboxes
        hook = self.action_hook
        for k in range(start, len(lane)):
            self._pc = k
            s, pc = lane[k]
            op, rel = prog.stages[s][pc]
            st = by_index[s]
            if op == U:
                if not skip_updates:
                    if hook is not None:
                        hook(s, "U", self.n_base + base + rel[-1])
                    st.update()
                continue
            i = base + rel
            tp = tps[s]
            if op == RF:
                early = self._early.pop(("act", i), None) if self._early else None
                if early is None:
                    try:
                        early = tp.recv("act", s, i, base + prog.certain[s][pc])
                    except PipelineInputError:
                        if rel == 0:  # stopped before the step: this rank's later stages too
                            self.rank.pass_error(s, i)
                        raise
                self.acts[(s, i)] = (early, None)
                got = prog.releases[s].get(pc)
                if got:
                    tp.release("grad", [base + m for m in got])
            elif op == RB:
                if ("grad", i) in self._early:
                    self.grads[(s, i)] = (self._early.pop(("grad", i)), None)
                else:
                    self.grads[(s, i)] = (tp.recv("grad", s, i, base + prog.certain[s][pc]), None)
                    if self.flags is not None:
                        self._flag_arrived(st, tp, i)
                    if self.carry_scales:
                        self._scale_arrived(s, tp, i)
            elif op == SF:
                tp.send("act", s, i, boxes[s].pop(("act", i)))
            elif op == SB:
                grad, flag = boxes[s].pop(("grad", i)), self._out_flags.pop((s, i), None)
                if self.carry_scales:  # (one P2PTransport per rank: asynchronous schedules)
                    tp.send("grad", s, i, grad, flag, self.loss_scaler.carried.pop((s - 1, i), None))
                else:
                    tp.send("grad", s, i, grad, flag)
            else:
                if hook is not None:
                    hook(s, OP_NAMES[op], self.n_base + i)
                if op == F:
                    self._rank_forward(st, i)
                elif op == W:
                    st.backward_weight(i, self.n_base + i)
                else:
                    self._rank_backward(st, i)

    def _rank_forward(self, st: Any, i: int) -> None:
        x, _, target, inp = self._forward_inputs(st, i)
        n = self.n_base + i
        out, loss = st.forward(i, n, x, target, self.scale)
        if not st.is_last:
            self._outboxes[st.index][("act", i)] = out
        elif loss is not None and inp is not None:
            self.losses.append((n, loss, inp.samples))
            if self.flags is not None:  # no host read: the flag travels with the gradients
                self.flags.mark(self.stages, i, loss)

    def _rank_backward(self, st: Any, i: int) -> None:
        s = st.index
        grad = None
        if not st.is_last:
            grad, _ = self.grads.pop((s, i))
        entry = st.stash.get(i) if self.flags is not None else None
        gin = st.backward(i, self.n_base + i, grad)
        if entry is not None and entry.flag is not None and s > 0:
            self._out_flags[(s, i)] = entry.flag
        if s > 0:
            if gin is DROPPED:
                raise PipelineInputError(
                    f"stage {s} has no gradient to send back for micro-batch {self.n_base + i}: "
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
        waits for stage ``s``'s backward of it (engine/runtime/amp.py)."""
        c = tp.arrived_scales.pop(i, None)
        if c is not None:
            self.loss_scaler.carried[(s, i)] = c

    # ------------------------------------------------------------------ saving in flight

    def _in_transit(self, channel: str) -> list[int]:
        """Micro-batches whose ``channel`` message the neighbour sent in this segment's steps
        so far and this rank has not received (the schedule says: both run the same programs;
        a message is received within a few steps of its send, 4S+4 is ample)."""
        s = self.s
        peer = s - 1 if channel == "act" else s + 1
        if not 0 <= peer < self.S:
            return []
        send, recv = (SF, RF) if channel == "act" else (SB, RB)
        sent: set[int] = set()
        got: set[int] = set()
        for jj in range(max(0, self.j - 4 * self.S - 4), self.j):
            prog, base = self.compiler.step(jj), jj * self.M
            sent.update(base + rel for op, rel in prog.stages[peer] if op == send)
            got.update(base + rel for op, rel in prog.stages[s] if op == recv)
        return sorted(sent - got)

    def wire_state(self) -> dict[str, Any]:
        """Messages at a step boundary, for the in-flight state (:mod:`~engine.runtime.inflight`;
        every rank calls it at the same step): what the neighbours sent and this rank has not
        received is received now and kept for its RF/RB op (the run does not change), this
        rank's own sends are waited for (its neighbours receive them in their call), and the
        outbox holds what it will send. A rank loading the result starts with those."""
        tp = self.transport
        for channel in ("act", "grad"):
            for mb in self._in_transit(channel):
                if (channel, mb) not in self._early:  # (an earlier save received it)
                    value = tp.recv(channel, self.s, mb)
                    if channel == "grad" and self.flags is not None:
                        self._flag_arrived(self.stage, tp, mb)
                    if channel == "grad" and self.carry_scales:
                        self._scale_arrived(self.s, tp, mb)
                    if value is not None:  # None: no leaf carries a gradient, nothing travels
                        self._early[(channel, mb)] = value
        tp.wait_sends()
        mail = [("received", self._early), ("outbox", self._outbox)]
        # the shapes the gradients of activations in flight travel with (a resumed rank has
        # not seen those activations travel)
        out: dict[str, Any] = {"shapes": tp.wire_shapes()}
        for key, box in mail:
            out[key] = []
            for (c, mb), v in sorted(box.items()):
                value, flags = trees.detached_copy(v)  # a tensor, or a tree of them
                flag = self._out_flags.get((self.s, mb)) if key == "outbox" and c == "grad" else None
                out[key].append({"channel": c, "mb": mb, "value": value, "grad": flags,
                                 "flag": None if flag is None else flag.clone()})
        return out

    def load_wire_state(self, state: dict[str, Any]) -> None:
        """Undo :meth:`wire_state` in a fresh rank: early receives, the outbox, and the shapes
        of the activations in flight (older states have none: the agreed shapes then)."""
        self._out_flags.clear()
        self.transport.restore_wire_shapes(state.get("shapes", {}))
        for key, box in (("received", self._early), ("outbox", self._outbox)):
            box.clear()
            for d in state[key]:
                box[(d["channel"], d["mb"])] = trees.with_grad_flags(d["value"], d["grad"])
                if d.get("flag") is not None:
                    self._out_flags[(self.s, d["mb"])] = d["flag"].to(self.transport.device)

    # ------------------------------------------------------------------ the step protocol

    def run_step(self, xs: list[Any], targets: list[Any], samples: list[int]) -> StepResult:
        with interrupt_at_step_end(self):  # Ctrl-C: raised after the step (rank_guard.py)
            return self._rank_step(xs, targets, samples)

    def _rank_step(self, xs: list[Any], targets: list[Any], samples: list[int]) -> StepResult:
        if not self.active:
            self._open_segment()
        j = self.j
        prog = self.compiler.step(j)
        base = j * self.M
        first = len(self.losses)
        point = rollback_point(self)  # (synchronous steps: RNG states and buffers)
        self._feed_rank(xs, targets, samples, base)
        self.rank.expect_loss()
        self.j += 1
        try:
            self._ops(prog, 0, base, skip_updates=self.sync)
        except PipelineInputError:
            if self.sync:  # a shape a stage cannot take: no update ran, the next step repeats it
                self._undo_step(base, point)
            raise
        if self.sync:  # an asynchronous step's last sends are received in the next step
            self._wait_sends()
        result = self._take_losses(first, base, base + self.M)
        loss, nonfinite = self.rank.share_loss(result.loss, result.nonfinite)
        self.steps += not (self.sync and nonfinite and self.on_nonfinite == "raise")  # as locally
        if self.sync:
            if nonfinite and self.on_nonfinite == "raise":
                self.dropped += nonfinite
                self._undo_step(base, point)
                raise NonFiniteLossError(nonfinite_message(
                    f"{nonfinite} micro-batch(es) of this step (seen by the last stage)",
                    "the step was rolled back on every rank: no weight or optimizer state changed.",
                ))
            point.commit()  # type: ignore[union-attr]
            if nonfinite:
                self.dropped += nonfinite
                for st in self.stages:
                    st.forget_pending()
                self.skipped_steps += 1
            else:  # per-stage optimizer failures as locally: the others update, then it raises
                try:
                    self._commit(prog, base)  # tied gradients and clipping first (sync_step.py)
                except BaseException:
                    self._end_step(prog)
                    raise
            for st in self.stages:
                st.reset_in_flight()
        elif nonfinite:
            raise NonFiniteLossError(
                f"{nonfinite} micro-batch(es) gave a non-finite loss at the last stage of an "
                f"asynchronous {self.spec.describe()} pipeline under a multi-process transport; "
                "their gradients were not dropped (that needs every stage in one process) and "
                "already entered updates. Reload the last checkpoint and lower the learning rate; "
                "on_nonfinite='skip_update' (engine.optim optimizers) skips such updates instead."
            )
        if prog.ends_segment:
            self._close_segment()
        return StepResult(loss)

    def _end_step(self, prog: StepProgram) -> None:
        """A synchronous step whose update phase raised ends like any other (the stages that
        could update did; the failing one skipped its update)."""
        for st in self.stages:
            st.reset_in_flight()
        if prog.ends_segment:
            self._close_segment()

    def _undo_step(self, base: int, point: Any = None) -> None:
        """Roll a synchronous step back on this rank (before its update phase): gradients and
        stashed activations dropped, the step's inputs forgotten, the step to be run again,
        the RNG states and buffers restored (``point``)."""
        for st in self.stages:
            st.forget_pending()
            st.reset_in_flight()
        for i in range(base, base + self.M):
            self.inputs.pop(i, None)
        for box in self._outboxes.values():
            box.clear()
        self.acts.clear()
        self.grads.clear()
        self.j -= 1
        restore(point)

    def _wait_sends(self) -> None:
        for tp in self.transports.values():
            tp.wait_sends()

    def _feed_rank(self, xs: list[Any], targets: list[Any], samples: list[int], base: int) -> None:
        first, last = 0 in self.by_index, self.S - 1 in self.by_index
        if not (first or last):
            return
        readers = (1 if first else 0) + (1 if last else 0)
        from engine.runtime.executor import _Input

        for i, (x, t, b) in enumerate(zip(xs, targets, samples, strict=True)):
            self.inputs[base + i] = _Input(x, t, b, readers)

    def drain(self) -> Tensor | None:
        if self.sync or not self.active:
            return None
        begin()
        try:
            with interrupt_at_step_end(self):
                return self._rank_drain()
        except BaseException as exc:
            lay = self.rank.layout
            report(lay.rank, exc)
            peer = as_peer_error(exc, lay.rank, f"stage {self.s} (rank {lay.rank})")
            if peer is exc:
                raise
            raise peer from exc

    def _rank_drain(self) -> Tensor | None:
        first = len(self.losses)
        prog = self.compiler.drain(self.j)
        self._ops(prog, 0, self.j * self.M, skip_updates=False)
        self._wait_sends()
        self._close_segment()
        return self._take_losses(first).loss

