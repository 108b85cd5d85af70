"""One process per stage (gloo/NCCL): runtime/ranks/, floor 9 of engine/runtime/.

Why a wing: building a rank's share (build_rank), its executor, its step call, configuration
agreement, first-failure reports, virtual stages, and the point-to-point transports
(transport/). Below the facade, above the parts.

Its files may import each other and every room below: setup/, capture/, exec/, stage/, ...,
parts.py, assemble.py; never a room above (tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``agreement``: Configuration agreement between the ranks of a multi-process pipeline, at
  construction.
- ``distributed``: What one rank of a multi-process pipeline does besides running its stage's
  actions.
- ``first_failure``: Which rank failed first: a note every rank of a multi-process pipeline can
  read.
- ``in_transit``: Messages in transit at a step boundary: received at an asynchronous NCCL
  step's end, saved with the in-flight state.
- ``lane``: The runner of one rank: its lane of each compiled step program, sends and receives
  included.
- ``mesh``: One DeviceMesh for the pipeline, data-parallel and tensor-parallel dimensions.
- ``rank``: One stage per process (gloo/NCCL): running a rank's step programs.
- ``rank_build``: Building one rank's share of a pipeline (gloo/NCCL): :func:`build_rank`.
- ``rank_step``: A rank's ``Pipeline.step`` call: what this rank reads of the user's batch, the
  shape handshake at its first step, and the translation of its failure for its peers.
- ``transport`` (a package): Transports: how activations and gradients travel between stages in
  different processes.
- ``virtual``: Virtual stages across processes (interleaved 1F1B under gloo/NCCL): v stages per
  rank.
"""
