"""Build tooling: what building and checking the compiled extension needs.

- ``cxx_runtime``: which libstdc++ a build links and a compiler that links it shared; setup.py
  and CMakeLists.txt load it by path, before engine is installed, so it uses the standard
  library only.
"""
