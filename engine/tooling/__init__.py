"""Build tooling: ``cxx_runtime`` (which libstdc++ a build links; loaded by path, stdlib only)."""
