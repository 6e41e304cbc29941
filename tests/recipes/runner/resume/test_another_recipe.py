"""A training command pointed at another recipe's run folder ends with one line naming both
recipes, exit 2, and leaves every file of that folder as it was: nothing is written before the
checks that can refuse a start have passed."""

import json

from recipes.__main__ import main
from tests.helpers import CHARLM_RUN, CIFAR_RUN, digests, one_error_line, train, write_text


def test_a_start_in_another_recipes_folder_is_refused_and_writes_nothing(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "text.txt")
    charlm = train([*CHARLM_RUN, "--text", "text.txt"], tmp_path / "charlm-run")
    cifar = train(CIFAR_RUN, tmp_path / "cifar-run")
    assert json.loads((cifar / "config.json").read_text())["recipe"] == "cifar"
    before = {run: digests(run) for run in (charlm, cifar)}
    capsys.readouterr()

    for recipe, folder, owner in ((CIFAR_RUN, charlm, "charlm"), (CHARLM_RUN, cifar, "cifar")):
        code = main([*recipe, "--run-dir", str(folder), "--allow-data-change", "true"])
        one_error_line(code, capsys.readouterr().err,
                       f"{folder} is a {owner} run; this is {recipe[0]}")
    assert {run: digests(run) for run in (charlm, cifar)} == before
