"""Running steps: runtime/exec/, floor 4 of engine/runtime/.

Why a wing: compiled step programs and what runs them: the executor and its step protocol
(synchronous commit and rollback, failure outcomes, Ctrl-C at action boundaries), the clock,
CUDA streams, clipping, and where each stage lives (placement). It drives stage/ and is
driven by capture/, the builders and the facade.

Its files may import each other and the rooms below: stage/, tensor_parallel, precision,
ties/; never a room above (tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``clipping``: Gradient-norm clipping across pipeline stages
  (``Pipeline(clip_grad_norm=...)``).
- ``clock``: The engine's own clock: bubble fractions of the actions that actually ran.
- ``executor``: The executor of one process: every stage's actions in the program's merged
  order.
- ``failures``: What the pipeline did about an exception inside a step, and where it happened:
  the notes every such exception carries.
- ``interrupts``: Ctrl-C inside a step, delivered at the next action boundary.
- ``placement``: Which rank of a multi-process pipeline holds which stage: round-robin, the V,
  or any map.
- ``program``: Step programs: a schedule's per-stage action streams, cut at ``step()``
  boundaries, once.
- ``protocol``: The step protocol: what one ``step()`` or ``flush()`` is, for one process or
  one rank.
- ``result``: What a step hands back (:class:`StepResult`) and what it keeps of each fed
  micro-batch (:class:`_Input`).
- ``rollback``: What a synchronous step restores when it fails: RNG states and module buffers.
- ``streams``: Per-stage streams: CUDA streams on a GPU, a do-nothing stand-in on the CPU.
"""
