"""The CIFAR recipe's default training iteration dispatches at most 250 aten ops (issue 38):
on a GPU the host's dispatches, not the device, bound this small net's step."""

import sys
from collections import Counter
from pathlib import Path

import torch

from benchmarks.tools.op_count import (
    COMPONENTS,
    MAX_OPS_PER_ITERATION,
    OTHER,
    OpCount,
    OpCounter,
    component_of,
    count_recipe_ops,
    default_config,
    render,
)


def test_default_recipe_iteration_dispatches_at_most_250_ops(tmp_path: Path) -> None:
    count = count_recipe_ops(default_config(tmp_path))
    assert count.by_component[OTHER] == 0, count.by_op
    # Every part of an iteration ran inside the window, each charged to its own component.
    for component in COMPONENTS:
        assert count.by_component[component] > 0, component
    assert count.per_iteration() <= MAX_OPS_PER_ITERATION, (
        {c: count.per_iteration(c) for c in COMPONENTS}, count.by_op.most_common(10))


def test_counter_charges_each_op_to_its_innermost_component() -> None:
    with OpCounter() as counter:
        torch.ones(2).add(1)
    assert counter.by_op == {"aten.ones": 1, "aten.add": 1}
    assert counter.by_component == {OTHER: 2}
    assert component_of(sys._getframe()) == OTHER


def test_the_report_row_gives_each_component_and_the_total_per_iteration() -> None:
    count = OpCount(2, Counter({"optimizer": 10, "handlers": 4}), Counter())
    row = render({"muon": count}).splitlines()[2]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "muon" and cells[-1] == "**7**"
    assert cells[1 + COMPONENTS.index("optimizer")] == "5"
    assert cells[1 + COMPONENTS.index("handlers")] == "2"
