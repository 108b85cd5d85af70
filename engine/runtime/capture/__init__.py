"""Capture and replay: runtime/capture/, floor 5 of engine/runtime/.

Why a wing: everything that records a step's launches once and replays them -- CUDA graphs of
each stage's optimizer step (``cuda_graphs="optimizer"``), of whole synchronous steps and of
asynchronous windows (``cuda_graphs="program"``) -- with what a replay, which runs no Python,
needs decided on the host, and the CPU twins that prove a replay equals the eager step. The
twins live beside what they check, so production code imports nothing from engine.testing.
Its files may import each other and the rooms below; never a room above (RUNTIME_FLOORS).

Files:

- ``optimizer_graphs``: CUDA graphs of the stages' optimizer steps.
- ``synchronous``: Whole synchronous steps captured as one graph.
- ``asynchronous``: Asynchronous windows (pb) captured as graphs.
- ``carry``: What an asynchronous window carries across windows, and whether a capture can.
- ``host_shift``: The host bookkeeping of one asynchronous window, applied after a replay.
- ``lr_feed``: An LR scheduler's values fed to a captured window from static slots.
- ``staging``: Static staging buffers: the batch copied to fixed addresses before a replay.
- ``dispatch_trace``: Every aten call a block of code makes (a warm-up's host reads; twins).
- ``graph_twin``: A CPU stand-in for ``torch.cuda.CUDAGraph`` that checks a replay.
- ``audit``: The capture preconditions of a pipeline's steady-state window, on a CPU.
- ``carry_audit``: The ring an asynchronous window needs, measured on a CPU.
"""
