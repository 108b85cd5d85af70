"""engine.demo.data: bundled datasets load offline, split and standardise deterministically, and
the epoch order is a pure function of (seed, epoch) -- what resuming relies on."""

from __future__ import annotations

import pytest
import torch

from engine.demo.data import DATASETS, DatasetError, epoch_order, load_dataset


@pytest.mark.parametrize("name", ["digits", "iris", "wine", "breast_cancer"])
def test_bundled_datasets_load_and_split(name: str) -> None:
    d = load_dataset(name)
    n = len(d.train_y) + len(d.test_y)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.train_x.shape[1] == d.test_x.shape[1] == d.num_features
    assert 0.15 < len(d.test_y) / n < 0.25
    # stratified: every class in both halves
    assert set(d.test_y.tolist()) == set(d.train_y.tolist()) == set(range(d.num_classes))
    # standardised with training statistics, and no feature blown up by a tiny std
    assert d.train_x.mean(0).abs().max() < 1e-4
    assert torch.isfinite(d.train_x).all() and torch.isfinite(d.test_x).all()


def test_digits_pixels_are_not_blown_up_by_rare_ink() -> None:
    d = load_dataset("digits")  # one std for all pixels: no 30-sigma inputs
    assert d.train_x.abs().max() < 6 and d.test_x.abs().max() < 6


def test_synthetic_is_larger_and_harder_than_digits() -> None:
    digits, synth = load_dataset("digits"), load_dataset("synthetic")
    assert len(synth.train_y) > 5 * len(digits.train_y)
    assert synth.num_classes == 10

    # a linear classifier (least squares on one-hot targets) separates digits far better
    def linear_acc(d: object) -> float:
        x = torch.cat([d.train_x, torch.ones(len(d.train_x), 1)], 1).double()
        t = torch.nn.functional.one_hot(d.train_y, d.num_classes).double()
        w = torch.linalg.solve(x.T @ x + 1e-3 * torch.eye(x.shape[1], dtype=x.dtype), x.T @ t)
        xt = torch.cat([d.test_x, torch.ones(len(d.test_x), 1)], 1).double()
        return float(((xt @ w).argmax(1) == d.test_y).double().mean())

    assert linear_acc(synth) < linear_acc(digits) - 0.3


def test_loading_is_deterministic() -> None:
    a, b = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)


def test_epoch_order_depends_only_on_seed_and_epoch() -> None:
    assert torch.equal(epoch_order(100, 3, 1), epoch_order(100, 3, 1))
    assert not torch.equal(epoch_order(100, 3, 1), epoch_order(100, 3, 2))
    assert sorted(epoch_order(100, 0, 0).tolist()) == list(range(100))


def test_unknown_dataset_names_the_choices() -> None:
    with pytest.raises(DatasetError, match="choose one of digits"):
        load_dataset("cifar10")
    assert "synthetic" in DATASETS
