"""What the command line trains: small models, their data sets and a generated corpus.

Why apart from the library: ``python -m engine train|compare`` and the benchmarks need a model
and data to run; a user's own model needs none of this. The library (engine.optim,
engine.runtime, ...) imports nothing from here.

- ``models``: Models the command line trains (a residual MLP, a small GPT), split into
  stages.
- ``data``: Datasets the command line trains on: only data that ships inside an installed
  package.
- ``corpus``: The language-model corpus: structured English-like text made by a seeded
  generator.
"""
