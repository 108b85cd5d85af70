"""Per-stage flat weight arena: a stage's parameters and gradients in flat, aligned buffers.

Why: a pipeline stage updates, snapshots and restores *all* of its weights at once, many
times per mini-batch. With one tensor per parameter each of those is a loop of small
kernel launches; with the weights in one flat buffer per (device, dtype, param group,
requires_grad) "bucket" it is one launch (optimizer step), one memcpy (a weight version)
or one access-policy window (L2 persistence). The buffers live in the C++ extension
(``engine._C``, csrc/arena.cpp); this module validates input, names things, and points the
modules' parameters at views of the buffers.

What changes for the user, and what does not:

* ``flatten_(model)`` keeps every ``nn.Parameter`` object (optimizers holding them keep
  working) and only re-points ``p.data`` at a view of the bucket's flat buffer and ``p.grad``
  at a view of the bucket's flat gradient buffer. Forward, backward, ``state_dict`` and
  ``load_state_dict`` behave as before; autograd accumulates into the views in place.
* Every tensor starts at a multiple of ``alignment`` bytes (256 by default); the padding
  between tensors is zero in the weights, the gradients and every slot, and stays zero under
  elementwise optimizer updates, so kernels may sweep whole buffers.
* Weight versions (PipeDream's stashed weights, 2BW's shadow copy, predicted weights) are
  *slots*: whole-arena buffers with the same layout. ``snapshot()`` copies live into one
  (on CUDA an asynchronous copy on the arena's own snapshot stream; readers wait on its event
  automatically), ``new_slot()`` hands one out uninitialised for callers that write it
  whole, and ``pin``/``release`` reference-count a slot per micro-batch and free it at
  zero. Freed slots' buffers stay in a per-arena pool for the next slot (steady state
  allocates nothing; ``trim_pool()`` gives them back, ``bytes()["pooled"]`` counts them).
* ``swap_live(slot)`` exchanges the live buffers with a slot's in O(1) (no bytes move): the
  parameters then view the other memory, and views taken before the swap (an in-flight
  graph's saved tensors) keep the old version, now the slot. ``rotation()`` builds
  PipeDream-2BW's double buffer on it: front = live, back = one slot.
* ``torch.optim``'s default ``zero_grad(set_to_none=True)`` drops the gradient views; the
  next backward then allocates fresh gradients. Call ``arena.zero_grad()`` (or
  ``optimizer.zero_grad(set_to_none=False)``) to keep them in the flat buffer, or
  ``arena.rebind_grads()`` to copy them back in.
* In-place writes through the flat buffers (e.g. a fused optimizer step) do not bump the
  parameters' autograd version counters, as with any ``.data`` update: do not step a stage
  while a graph that saved its weights still has to run backward on them (the pipeline
  stashes weight versions in slots for exactly that).

L2 persistence on a CPU tensor (or in an extension built without CUDA) does not raise: it
returns an :class:`L2Persistence` with ``supported=False`` and the reason, because the same
stage code runs on CPU and GPU machines and a benchmark wants to report "not available"
rather than crash. Everything else that is wrong raises before any tensor moves.

Layout of the package (imports only go down this list, so there are no cycles):

* ``core``          errors, the compiled core (``engine._C``), alignment checks;
* ``views``         value types: ``BucketInfo``, ``L2Persistence``, ``FlatView``;
* ``registry``      which arena owns which parameter; ``flat_buffers_for``;
* ``double_buffer`` ``DoubleBuffer`` (2BW: live + one slot, swapped by ``swap_live``);
* ``l2``            L2 persistence requests over a live buffer;
* ``weight_arena``  ``WeightArena``: buffers, slots, pool, swap, accounting;
* ``flatten``       ``flatten_``: validation, then one move.
"""

from __future__ import annotations

from engine.arena.core import DEFAULT_ALIGNMENT, ArenaError, SlotError
from engine.arena.double_buffer import DoubleBuffer
from engine.arena.flatten import flatten_
from engine.arena.registry import flat_buffers_for
from engine.arena.views import BucketInfo, FlatView, L2Persistence
from engine.arena.weight_arena import WeightArena

__all__ = [
    "DEFAULT_ALIGNMENT",
    "ArenaError",
    "BucketInfo",
    "DoubleBuffer",
    "FlatView",
    "L2Persistence",
    "SlotError",
    "WeightArena",
    "flat_buffers_for",
    "flatten_",
]
