"""What the CIFAR recipe tells the run layer about its data."""

import dataclasses

from recipes.cifar.config import Config
from recipes.cifar.recipe import data_source


def test_the_header_says_when_the_test_split_validates_and_picks_best():
    config = Config(dataset="synthetic")
    assert data_source(config) == (
        "synthetic images (validation: the test split, which also picks best.pt; "
        "--val-fraction 0.1 holds out training images instead)")
    held_out = dataclasses.replace(config, val_fraction=0.1)
    assert data_source(held_out) == (
        "synthetic images (validation: the last 10% of train held out; the test split stays "
        "unseen until evaluate --split test)")
