import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.arms.loops import ARMS, ArmResult
from benchmarks.sections.s1_overhead import OverheadResult
from benchmarks.tools import versus

ROOT = Path(__file__).resolve().parents[3]


def in_git_checkout() -> bool:
    result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    return result.returncode == 0


def has_revision(rev: str) -> bool:
    result = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}^{{commit}}"],
                            capture_output=True)
    return result.returncode == 0


needs_git = pytest.mark.skipif(not in_git_checkout(), reason="not a git checkout")
FLAT_REVISION = "72c5f4f"  # the last revision with benchmarks/ as one flat folder


def test_imports_of_the_exported_packages_point_at_their_copies():
    source = "\n".join([
        "from engine import create_trainer",
        "    from handlers.tensorboard import TensorBoardLogger",
        "import recipes.cifar.recipe as cifar",
        "import engine.step",
        "from benchmarks.arms.recipe_handlers import RecipeHandlers",
        "from benchmarks.harness.lockstep import run_lockstep",
        "from benchmarks.arms.workloads import Workload",
        "from engineering import nothing",
        "import torch",
    ])
    assert versus.rewrite_imports(source, versus.BY_ROLE).splitlines() == [
        "from before_engine import create_trainer",
        "    from before_handlers.tensorboard import TensorBoardLogger",
        "import before_recipes.cifar.recipe as cifar",
        "import before_engine.step; engine = before_engine",
        "from before_benchmarks.arms.recipe_handlers import RecipeHandlers",
        "from benchmarks.harness.lockstep import run_lockstep",
        "from benchmarks.arms.workloads import Workload",
        "from engineering import nothing",
        "import torch",
    ]


def test_a_flat_revision_s_benchmark_imports_point_at_the_copies_or_where_they_are_now():
    source = "\n".join([
        "from benchmarks.recipe_handlers import RecipeHandlers",
        "from benchmarks.lockstep import run_lockstep",
        "from benchmarks.timing import WindowTimer",
        "import benchmarks.workloads as workloads",
        "from benchmarks.arms.workloads import Workload",
    ])
    assert versus.rewrite_imports(source, versus.FLAT).splitlines() == [
        "from before_benchmarks.recipe_handlers import RecipeHandlers",
        "from benchmarks.harness.lockstep import run_lockstep",
        "from benchmarks.harness.timing import WindowTimer",
        "import benchmarks.arms.workloads as workloads",
        "from benchmarks.arms.workloads import Workload",
    ]


def test_a_plain_import_of_a_moved_module_is_refused():
    with pytest.raises(versus.RevisionError, match="benchmarks.harness.timing now"):
        versus.rewrite_imports("import benchmarks.timing", versus.FLAT)


def test_an_import_of_two_modules_in_one_statement_is_refused():
    with pytest.raises(versus.RevisionError, match="one module an import"):
        versus.rewrite_imports("import engine.step, handlers", versus.BY_ROLE)


def test_the_layout_is_the_one_whose_arms_module_the_revision_has(tmp_path):
    (tmp_path / "benchmarks" / "arms").mkdir(parents=True)
    with pytest.raises(versus.RevisionError, match="neither benchmarks/arms/loops.py nor "
                                                   "benchmarks/arms.py"):
        versus.layout_of(tmp_path, "old")
    (tmp_path / "benchmarks" / "arms.py").touch()
    assert versus.layout_of(tmp_path, "old") is versus.FLAT
    (tmp_path / "benchmarks" / "arms" / "loops.py").touch()
    assert versus.layout_of(tmp_path, "new") is versus.BY_ROLE


@needs_git
def test_head_against_the_working_tree_side_by_side(capsys):
    status = versus.main(["HEAD", "--repeats", "1", "--iterations", "20"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[0] for row in rows] == ["| `trainer`", "| `trainer+recipe`"]
    # An unchanged tree trains the same weights; exit status 1 says that it does not.
    assert status == (1 if "differs" in out else 0)
    assert not any(name.startswith("before_") for name in sys.modules)
    assert not any("@" in arm for arm in ARMS)


@needs_git
@pytest.mark.skipif(not has_revision(FLAT_REVISION), reason=f"{FLAT_REVISION} not in this clone")
def test_a_revision_with_the_flat_layout_gives_its_arms():
    with versus.revision_arms(FLAT_REVISION) as arms:
        assert sorted(arms) == [f"trainer+recipe@{FLAT_REVISION}", f"trainer@{FLAT_REVISION}"]
        assert all(callable(arm) for arm in arms.values())
    assert not any(name.startswith("before_") for name in sys.modules)


@needs_git
def test_an_unknown_revision_exits_2_with_gits_reason(capsys):
    assert versus.main(["no-such-revision"]) == 2
    assert "git archive no-such-revision failed" in capsys.readouterr().err


def test_a_revision_without_the_arms_is_refused(monkeypatch, capsys):
    def export_old_arms(rev, into, repo=ROOT):
        (into / "before_benchmarks").mkdir()
        (into / "before_benchmarks" / "__init__.py").write_text("")
        (into / "before_benchmarks" / "arms.py").write_text("class ArmResult:\n    seconds = 0\n")
        return versus.FLAT

    monkeypatch.setattr(versus, "export_revision", export_old_arms)
    assert versus.main(["old"]) == 2
    assert "predates the arms" in capsys.readouterr().err
    assert not any(name.startswith("before_") for name in sys.modules)


@pytest.mark.parametrize("argv", [["--iterations", "15"], ["--repeats", "0"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exit_info:
        versus.parse_args(argv)
    assert exit_info.value.code == 2


def test_probe_losses_that_differ_are_reported():
    def run(loss: float) -> ArmResult:
        return ArmResult(1.0, 0.0, loss, (1.0,))

    result = OverheadResult("tiny", 32, 0, 1, {"a": [run(1.0)], "b": [run(1.5)],
                                               "c": [run(1.0)]})
    assert versus._parity(result, "a", "b") == "differs by 5.0e-01"
    assert versus._parity(result, "a", "c") == "the same"
