"""What a built pipeline saves and reports: runtime/state/, floor 9 of engine/runtime/.

Why a wing: state dicts, the in-flight state of an unflushed pipeline, forward-only evaluation,
stats() and throughput. They take PipelineParts (runtime/parts.py), never the facade.

Its files may import each other and every room below: setup/, capture/, exec/, stage/, ...,
parts.py, assemble.py; never a room above (tests/test_layout.py, RUNTIME_FLOORS).

Files:

- ``evaluation``: Forward-only evaluation through a pipeline: ``Pipeline.evaluate``.
- ``inflight``: In-flight state of an unflushed asynchronous pipeline: saved with its state
  dict, rebuilt on load, so that save at step k + load + continue equals the never-interrupted
  run bit for bit.
- ``model_index``: What a stage's state records about its tensors' places in the whole model
  (model names, tensor-parallel pieces, carried ties).
- ``pipeline_stats``: ``Pipeline.stats()``: the facts a run reports, gathered in one place.
- ``relayout``: Loading a checkpoint into another layout of the same model: this process's
  stage states, translated from the saved ones by model name.
- ``saved_index``: A saved checkpoint seen by the whole model's names: where each tensor's
  pieces are, read only when a stage needs them.
- ``state``: Pipeline state dicts: everything needed to resume bit-identically.
- ``throughput``: Throughput of a pipeline as the user sees it: step time, samples/s, tokens/s,
  and the measured bubble next to the modelled one (``stats()["throughput"]``).
"""
