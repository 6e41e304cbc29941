"""The run layer's cost keys: a recipe that cannot recompute its blocks refuses
--activation-checkpointing with one line, before anything is written or loaded."""

import pytest

from recipes.__main__ import main
from tests.helpers import one_error_line


@pytest.mark.parametrize("command", [[], ["--describe"], ["--lr-find"]])
def test_a_recipe_without_blocks_refuses_activation_checkpointing(tmp_path, monkeypatch,
                                                                  capsys, command):
    monkeypatch.chdir(tmp_path)
    code = main(["cifar", "--activation-checkpointing", "true", "--data-dir", "nowhere",
                 *command])
    one_error_line(code, capsys.readouterr().err, "--activation-checkpointing: the cifar "
                   "recipe's model has no blocks", "charlm")
    assert list(tmp_path.iterdir()) == []
