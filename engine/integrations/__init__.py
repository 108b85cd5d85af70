"""Other libraries' models in the engine, one module per library.

- ``hf``: Hugging Face causal language models cut into pipeline stages, with their tensors'
  model names (``engine.integrations.hf.split_causal_lm``).
"""
