"""Capture and replay: runtime/capture/, floor 5 of engine/runtime/.

Why a wing: everything that records a step's launches once and replays them -- CUDA graphs of
each stage's optimizer step (``cuda_graphs="optimizer"``), of whole synchronous steps and of
asynchronous windows (``cuda_graphs="program"``) -- together with the CPU twins that prove a
replay equals the eager step it stands for. A replay runs no Python, so what the host would
have done (counters, the batch's addresses, an LR schedule's values, what a window carries
into the next) is decided here, next to the capture that needs it. The twins live beside the
code they check, so production code imports nothing from engine.testing.

Its files may import each other and the rooms below: stage/, exec/, precision, ties,
tensor_parallel; never a room above (tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``optimizer_graphs``: CUDA graphs of the stages' optimizer steps
  (``Pipeline(cuda_graphs=True)``).
- ``synchronous``: Whole synchronous steps captured as one graph
  (``Pipeline(cuda_graphs="program")``).
- ``asynchronous``: Asynchronous windows captured as graphs (``Pipeline(cuda_graphs="program")``
  with pb).
- ``carry``: What an asynchronous window carries across windows, and whether a capture can
  carry it.
- ``host_shift``: The host bookkeeping of one asynchronous window, applied after a replay.
- ``lr_feed``: An LR scheduler's values fed to a captured asynchronous window from static
  slots.
- ``staging``: Static staging buffers: the user's batch copied to fixed addresses before a
  captured step.
- ``dispatch_trace``: Every aten call a block of code makes, recorded through a
  ``TorchDispatchMode`` (a warm-up step's host reads; the twins' recordings).
- ``graph_twin``: A CPU stand-in for ``torch.cuda.CUDAGraph`` that checks what a replay would
  get wrong.
- ``audit``: The CUDA-graph capture preconditions of a pipeline's steady-state window, checked
  on a CPU.
- ``carry_audit``: The ring an asynchronous window needs, measured on a CPU.
"""
