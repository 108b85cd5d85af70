"""Other libraries' models in the engine: ``hf`` (Hugging Face causal LMs cut into stages)."""
