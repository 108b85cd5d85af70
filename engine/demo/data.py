"""Datasets the command line trains on: only data that ships inside an installed package.

Why these: the command line must work offline, on a fresh CPU machine, in minutes, and give
the same numbers on every run. Nothing here downloads (scikit-learn's ``fetch_*`` functions
do, so they are not used).

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 64 features, 10
  classes). Real data, tiny, learnable to about 95% by a small MLP in a few epochs.
* ``synthetic``: a fixed-seed ``sklearn.datasets.make_classification`` problem that is
  genuinely larger and harder than digits: 12,000 samples, 40 features (20 informative, 10
  redundant, 10 noise), 10 classes made of 3 Gaussian clusters each (so no linear model
  separates them), tight class separation (0.9) and 5% of labels flipped at random (so 100% is
  unreachable; a model that fits the noise is overfitting). The bundled sklearn sets
  (iris 150, wine 178, breast_cancer 569 samples) are all *smaller and easier* than digits,
  which is why the harder choice is a seeded generator.
* ``breast_cancer``, ``wine``, ``iris``: the other bundled sklearn tables, for quick checks.

* ``lm`` (``--task lm``): next-character prediction on the generated corpus of
  ``engine.demo.corpus`` (120,000 ASCII bytes, 29 symbols, sha256-checked by the tests), cut into
  non-overlapping windows of ``LM_CONTEXT`` + 1 characters; x is a window's first
  ``LM_CONTEXT`` characters and y the same shifted by one. The last 10% of the windows are the
  test set (a contiguous tail, not a shuffle, so no test text overlaps training text).

Every classification dataset is split once into train/test with a fixed seed (stratified) and standardised
with the *training* mean and standard deviation (per feature; digits' pixels share one
unit and one std). :func:`epoch_order` gives the shuffled order
of an epoch as a pure function of (seed, epoch), so a run resumed at an epoch boundary sees
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and torch load on first use: `python -m engine --help` stays fast
    import numpy as np
    import torch
    from torch import Tensor

__all__ = [
    "DATASETS",
    "Dataset",
    "load_dataset",
    "load_lm_dataset",
    "LM_CONTEXT",
    "epoch_order",
    "DatasetError",
]

#: characters per language-model sample (the model's context)
LM_CONTEXT = 32


class DatasetError(ValueError):
    """An unknown dataset name or a dataset that cannot be loaded; the message says the fix."""


@dataclass(frozen=True)
class Dataset:
    """A standardised, split classification dataset as float32 / int64 tensors."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    description: str

    @property
    def num_features(self) -> int:
        return int(self.train_x.shape[1])

    def to(self, device: str | torch.device) -> Dataset:
        return Dataset(
            self.name,
            self.train_x.to(device),
            self.train_y.to(device),
            self.test_x.to(device),
            self.test_y.to(device),
            self.num_classes,
            self.description,
        )


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def _synthetic() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification

    return make_classification(
        n_samples=12_000,
        n_features=40,
        n_informative=20,
        n_redundant=10,
        n_classes=10,
        n_clusters_per_class=3,
        class_sep=0.9,
        flip_y=0.05,
        random_state=1234,
    )


def _sk(name: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    def load() -> tuple[np.ndarray, np.ndarray]:
        import sklearn.datasets

        return getattr(sklearn.datasets, f"load_{name}")(return_X_y=True)

    return load


#: name -> (loader, one-line description)
DATASETS: dict[str, tuple[Callable[[], tuple[np.ndarray, np.ndarray]], str]] = {
    "digits": (_digits, "sklearn load_digits: 1,797 8x8 digit images, 64 features, 10 classes"),
    "synthetic": (
        _synthetic,
        "sklearn make_classification (seed 1234): 12,000 samples, 40 features, 10 classes x 3 "
        "clusters, class_sep 0.9, 5% label noise",
    ),
    "breast_cancer": (
        _sk("breast_cancer"),
        "sklearn load_breast_cancer: 569 samples, 30 features, 2 classes",
    ),
    "wine": (_sk("wine"), "sklearn load_wine: 178 samples, 13 features, 3 classes"),
    "iris": (_sk("iris"), "sklearn load_iris: 150 samples, 4 features, 3 classes"),
}


#: datasets whose features are measured in one common unit (scaled by one global std)
SHARED_UNITS = frozenset({"digits"})


def load_dataset(name: str, *, test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    """Load ``name``, split it (stratified, fixed seed) and standardise with train statistics."""
    if name not in DATASETS:
        raise DatasetError(
            f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)} "
            "(all ship inside scikit-learn, nothing is downloaded)"
        )
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction={test_fraction!r} must lie strictly between 0 and 1")
    import numpy as np
    import torch

    loader, description = DATASETS[name]
    try:
        X, y = loader()
    except ImportError as exc:
        raise DatasetError(
            f"dataset {name!r} needs scikit-learn: pip install scikit-learn ({exc})"
        ) from exc
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.int64)
    rng = np.random.default_rng(split_seed)
    test_idx: list[np.ndarray] = []
    for c in np.unique(y):  # stratified split: every class keeps its share in both halves
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.append(idx[: max(1, int(round(len(idx) * test_fraction)))])
    test = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(len(y)), test)
    mean = X[train].mean(axis=0)
    std = X[train].std(axis=0)
    if name in SHARED_UNITS:
        # Pixels share one unit (ink, 0..16): scale them all by one std. A per-pixel z-score
        # would turn the rare ink of almost-always-blank pixels into 30-40 sigma inputs whose
        # gradients blow up a batch-size-1 update (the setting the comparison is about).
        std = np.full_like(std, X[train].std())
    std[std == 0] = 1.0  # constant features stay 0 instead of dividing by zero
    Xs = (X - mean) / std
    return Dataset(
        name,
        torch.tensor(Xs[train], dtype=torch.float32),
        torch.tensor(y[train]),
        torch.tensor(Xs[test], dtype=torch.float32),
        torch.tensor(y[test]),
        int(y.max()) + 1,
        description,
    )


def load_lm_dataset(context: int = LM_CONTEXT, *, test_fraction: float = 0.1) -> Dataset:
    """The corpus as (window, next-character window) pairs of token ids, split by position."""
    if context < 1:
        raise DatasetError(f"context={context} must be >= 1")
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction={test_fraction!r} must lie strictly between 0 and 1")
    import torch

    from engine.demo.corpus import ALPHABET, CORPUS_SEED, encode, generate_corpus

    ids = torch.tensor(encode(generate_corpus()), dtype=torch.int64)
    n = len(ids) // (context + 1)
    windows = ids[: n * (context + 1)].view(n, context + 1)
    n_test = max(1, int(round(n * test_fraction)))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    return Dataset(
        "lm",
        x[:-n_test],
        y[:-n_test],
        x[-n_test:],
        y[-n_test:],
        len(ALPHABET),
        f"generated corpus (engine/demo/corpus.py, seed {CORPUS_SEED}): {len(ids):,} characters, "
        f"{len(ALPHABET)} symbols, windows of {context}",
    )


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    """The shuffled sample order of ``epoch`` (0-based): depends only on (n, seed, epoch)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)
