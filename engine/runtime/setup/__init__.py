"""Setting up the pieces: runtime/setup/, floor 6 of engine/runtime/.

Why a wing: what a build makes before the assembly: validated options (config), stage
modules and weight stores, automatic balance and schedule choice, deferred BatchNorm, the L2
plan, host memory, and the step features (clipping, mixed precision, offload) attached at the
end of a build. The assembly of these into PipelineParts is runtime/assemble.py, two floors
above (runtime/parts.py between).

Its files may import each other and the rooms below: capture/, exec/, tensor_parallel, stage/,
precision, ties/; never a room above
(tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``auto_schedule``: ``schedule="auto"``: the stage costs measured or read, then the chooser's
  pick.
- ``balance``: ``balance="time"`` / ``"memory"``: partition an nn.Sequential automatically.
- ``batch_norm``: BatchNorm whose running statistics cover the whole mini-batch, not each
  micro-batch.
- ``config``: Pipeline options: validated once, before any weight exists, into one frozen
  config.
- ``host_memory``: CPU stages keep freed memory for reuse, as CUDA's caching allocator does on
  a GPU.
- ``l2``: On-chip weights: the persisting-L2 set-aside of a GPU split across the stages on it.
- ``mesh_option``: The ``mesh=`` option checked with the other options, before anything is
  built.
- ``step_features``: The training features layered on a pipeline's step: clipping, mixed
  precision, offload.
- ``stores``: Building a pipeline's stages: modules, optimizers, weight arenas, stores.

"""
