"""One stage: runtime/stage/, floor 2 of engine/runtime/.

Why a wing: what a single stage is and does: its module, weights (live buffers, kept versions,
saved-tensor hooks), weight policy, activation stash, optimizer bridge and update, the tensor
trees it takes and returns, and the action labels and trace it writes (mixed precision is
runtime/precision.py, below it). Nothing here knows a
schedule, an executor, another process or the facade: a stage is driven from above.

Its files may import each other and the rooms below: precision, ties/; never a room
above (tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``device_flags``: Non-finite losses of asynchronous schedules as device flags
  (``on_nonfinite="skip_update"``).
- ``fresh_grads``: Weight gradients accumulated into the flat buffers with one multi-tensor add
  per backward.
- ``inputs``: Inputs of a step: the split into micro-batches and the dry-run check before
  anything runs.
- ``labels``: What the runtime is doing right now: profiler labels and the current action.
- ``offload``: Activation offload (``Pipeline(offload_activations=True)``): saved activations
  wait for their backward in host memory (pinned on CUDA) instead of on the device.
- ``optim_bridge``: What the runtime asks of a stage optimizer, for engine.optim and plain
  torch.optim alike.
- ``policy``: Weight policies: which weights a stage's forward and backward of micro-batch i
  read.
- ``saved_weights``: Saved-tensor hooks that make a backward read other weights than its
  forward ran on.
- ``stage``: One pipeline stage: its module, weight store, optimizer, activation stash and the
  F/B/U actions that run on it.
- ``stage_update``: A stage's update: the group's gradient made final, clipped, stepped; and
  its recovery.
- ``stash``: Activations a stage holds between a micro-batch's forward and its backward.
- ``trace``: A trace of what ran: Chrome/Perfetto trace-event JSON of a pipeline's executed
  actions.
- ``trees``: Tensor trees between stages: what a stage takes and returns, and how the runtime
  walks it.
- ``weight_store``: A stage's weights: the live buffers in the C++ arena, the versions kept for
  micro-batches in flight, and one transient buffer for computed weights.
"""
