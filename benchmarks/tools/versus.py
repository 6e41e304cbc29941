"""Before and after, side by side: the engine arms of a git revision against the working
tree's, in one process, block by block:
``python -m benchmarks.tools.versus [REV] [--repeats N] [--iterations N]`` (REV: HEAD).

Two ``make bench`` runs taken an hour apart do not compare: this machine's overall speed
moves between runs, and every overhead in µs with it (Ignite's stock trainer, unchanged,
read +59.5 and +79.9 µs in two runs of one evening). Here the revision's ``engine``,
``handlers`` and ``recipes`` packages and its two arm modules (``benchmarks/arms/loops.py``
and ``benchmarks/arms/recipe_handlers.py``; ``benchmarks/arms.py`` and
``benchmarks/recipe_handlers.py`` while ``benchmarks/`` was one flat folder) are exported by
``git archive`` into a temporary directory as packages of their own (``before_engine``, ...:
their import statements are rewritten), and their ``trainer`` and ``trainer+recipe`` arms
run in the same lockstep rounds as the working tree's and the tuned hand loop
(``benchmarks.harness.lockstep``), on the tiny model of ``make bench``'s section 1. The
table gives each arm's overhead over the tuned loop now and at REV, and now minus REV per
paired block: median and 95% interval.

The revision must have the arms' current calling convention (``Workload`` in,
``ArmResult`` with blocks out: 2026-11-25 on); an older one is refused with the reason.
Exit status 0; 1 when an arm of the two revisions trained to different probe losses
(the change is then not an engine-speed change alone); 2 when REV cannot be exported.
"""

import argparse
import dataclasses
import importlib
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.arms.loops import ARMS, ArmResult
from benchmarks.arms.workloads import Workload, tiny_workload
from benchmarks.harness.plan import FULL
from benchmarks.harness.report import table
from benchmarks.sections import s1_overhead

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "handlers", "recipes")
COMPARED = {"trainer": "our_trainer", "trainer+recipe": "our_trainer_with_recipe_handlers"}
REFERENCE = s1_overhead.TUNED
PREFIX = "before_"
# ``from X...`` / ``import X...`` of one of the packages whose modules may be exported.
_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)(?P<keyword>from|import)[ \t]+"
    r"(?P<module>(?:engine|handlers|recipes|benchmarks)(?:\.\w+)*)(?!\w)"
    r"(?P<rest>.*)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Layout:
    """Where a revision's ``benchmarks/`` keeps the two modules exported with it, and where
    the working tree now keeps the other benchmark modules they import (those are not
    exported: the arms must share the working tree's lockstep rounds and workloads)."""

    arms: str
    recipe_handlers: str
    moved: Mapping[str, str]  # the revision's module name -> the working tree's

    @property
    def exported(self) -> tuple[str, str]:
        return (self.arms, self.recipe_handlers)


# By role: sections/, arms/, harness/, tools/ (the working tree's).
BY_ROLE = Layout("benchmarks.arms.loops", "benchmarks.arms.recipe_handlers", {})
# One flat folder, up to 72c5f4f.
FLAT = Layout("benchmarks.arms", "benchmarks.recipe_handlers", {
    "benchmarks.lockstep": "benchmarks.harness.lockstep",
    "benchmarks.timing": "benchmarks.harness.timing",
    "benchmarks.workloads": "benchmarks.arms.workloads",
})
LAYOUTS = (BY_ROLE, FLAT)


class RevisionError(RuntimeError):
    """The revision cannot be exported or does not have the arms this tool runs."""


def source_path(module: str) -> str:
    """``benchmarks.arms.loops`` -> ``benchmarks/arms/loops.py``."""
    return module.replace(".", "/") + ".py"


def renamed(module: str) -> str:
    """The exported copy's name of ``module`` (``engine`` -> ``before_engine``,
    ``benchmarks.arms.loops`` -> ``before_benchmarks.arms.loops``)."""
    return PREFIX + module


def rewrite_imports(source: str, layout: Layout) -> str:
    """``source`` with every import of an exported package or module pointed at its copy,
    and every import of a benchmark module that moved since ``layout`` pointed at its place
    in the working tree; an ``import X.y`` keeps its name ``X`` bound, as before the
    rewrite."""
    def replace(match: re.Match) -> str:
        indent, keyword, module, rest = match.group("indent", "keyword", "module", "rest")
        if module in layout.moved:
            if keyword == "import" and " as " not in rest:
                raise RevisionError(f"cannot rewrite {match.group(0).strip()!r}: the module "
                                    f"is {layout.moved[module]} now; import from it, please")
            return f"{indent}{keyword} {layout.moved[module]}{rest}"
        if module.split(".")[0] not in PACKAGES and module not in layout.exported:
            return match.group(0)
        if keyword == "from":
            return f"{indent}from {renamed(module)}{rest}"
        if "," in rest:
            raise RevisionError(f"cannot rewrite {match.group(0).strip()!r}: one module an "
                                "import, please")
        if " as " in rest:
            return f"{indent}import {renamed(module)}{rest}"
        top = module.split(".")[0]
        return f"{indent}import {renamed(module)}{rest}; {top} = {renamed(top)}"
    return _IMPORT.sub(replace, source)


def layout_of(tree: Path, rev: str) -> Layout:
    """The layout of the exported ``tree`` of ``rev``: the first whose arms module it has."""
    for layout in LAYOUTS:
        if (tree / source_path(layout.arms)).is_file():
            return layout
    names = " nor ".join(source_path(layout.arms) for layout in LAYOUTS)
    raise RevisionError(f"{rev} has neither {names}: it predates the arms this tool runs "
                        "(2026-11-25)")


def export_revision(rev: str, into: Path, repo: Path = ROOT) -> Layout:
    """``rev``'s packages and arm modules under ``into``, renamed and rewritten; its
    layout."""
    archive = into / "rev.tar"
    result = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar",
                             f"--output={archive}", rev, *PACKAGES, "benchmarks"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RevisionError(f"git archive {rev} failed: {result.stderr.strip()}")
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    layout = layout_of(tree, rev)
    for package in PACKAGES:
        (tree / package).rename(into / renamed(package))
    for module in layout.exported:
        copy = into / source_path(renamed(module))
        copy.parent.mkdir(parents=True, exist_ok=True)
        (tree / source_path(module)).rename(copy)
    for folder in (into / f"{PREFIX}benchmarks").glob("**/"):
        (folder / "__init__.py").touch()  # the copy's own: the revision's may import more
    for path in into.glob(f"{PREFIX}*/**/*.py"):
        path.write_text(rewrite_imports(path.read_text(), layout))
    return layout


@contextmanager
def revision_arms(rev: str) -> Iterator[dict[str, Callable[[Workload], ArmResult]]]:
    """The revision's compared arms (``"trainer@REV"``, ...), imported from a copy that is
    forgotten again afterwards (modules, path, directory)."""
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp:
        layout = export_revision(rev, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            yield _import_arms(rev, layout)
        finally:
            sys.path.remove(tmp)
            for name in [name for name in sys.modules if name.startswith(PREFIX)]:
                del sys.modules[name]


def _import_arms(rev: str, layout: Layout) -> dict[str, Callable[[Workload], ArmResult]]:
    where = f"{rev}'s {source_path(layout.arms)}"
    try:
        arms = importlib.import_module(renamed(layout.arms))
    except Exception as error:  # any import failure of old code: say which revision
        raise RevisionError(f"{where} does not import here: "
                            f"{type(error).__name__}: {error}") from error
    missing = [name for name in COMPARED.values() if not hasattr(arms, name)]
    if missing or "blocks" not in getattr(arms.ArmResult, "__dataclass_fields__", {}):
        raise RevisionError(f"{where} has no {', '.join(missing) or 'blocks'}: it predates "
                            "the arms this tool runs (2026-11-25)")
    return {f"{arm}@{rev}": getattr(arms, function) for arm, function in COMPARED.items()}


def compare(before: dict[str, Callable[[Workload], ArmResult]], workload: Workload,
            repeats: int, log: Callable[[str], None]) -> s1_overhead.OverheadResult:
    """``repeats`` lockstep runs of the tuned loop, the working tree's compared arms and
    ``before``'s. The signal handlers are put back afterwards: two recipe handler sets
    running at once restore each other's graceful-stop handlers out of order."""
    ARMS.update(before)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return s1_overhead.measure(workload, repeats, 1, log,
                                   arms=[REFERENCE, *COMPARED, *before])
    finally:
        for name in before:
            del ARMS[name]
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def render(result: s1_overhead.OverheadResult, rev: str) -> str:
    def difference(arm: str, reference: str) -> str:
        return s1_overhead.paired_interval(result, arm, reference, lambda a, r: a - r, 3, 1e6)

    rows = [[f"`{arm}`", difference(arm, REFERENCE), difference(f"{arm}@{rev}", REFERENCE),
             difference(arm, f"{arm}@{rev}"), _parity(result, arm, f"{arm}@{rev}")]
            for arm in COMPARED]
    per_block = result.block or result.timed
    pairs = len(result.runs[REFERENCE]) * (result.timed // per_block)
    return (f"Tiny model, {result.warmup} warm-up + {result.timed} timed iterations per repeat in "
            f"blocks of {per_block}, {len(result.runs[REFERENCE])} repeats ({pairs} paired "
            f"blocks per arm); µs per iteration, median (95% interval).\n\n"
            + table(["arm", f"over `{REFERENCE}`, now", f"over `{REFERENCE}`, at {rev}",
                     f"now - {rev}", "probe loss"], rows))


def _parity(result: s1_overhead.OverheadResult, now: str, before: str) -> str:
    losses = {run.probe_loss for arm in (now, before) for run in result.runs[arm]}
    return "the same" if len(losses) == 1 else f"differs by {max(losses) - min(losses):.1e}"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.versus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", default="HEAD",
                        help="the git revision to compare against (default HEAD)")
    parser.add_argument("--repeats", type=int, default=FULL.tiny_repeats,
                        help=f"lockstep runs (default {FULL.tiny_repeats}, as make bench)")
    parser.add_argument("--iterations", type=int, default=FULL.tiny_timed,
                        help=f"timed iterations per run, a multiple of {FULL.tiny_block} "
                             f"(default {FULL.tiny_timed})")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.iterations < FULL.tiny_block or args.iterations % FULL.tiny_block:
        parser.error(f"--iterations must be a positive multiple of {FULL.tiny_block}, got "
                     f"{args.iterations}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # make bench's tiny section, but for its length: the same warm-up and blocks.
    workload = dataclasses.replace(tiny_workload(FULL.tiny_warmup, args.iterations),
                                   block=FULL.tiny_block)
    try:
        with revision_arms(args.rev) as before:
            result = compare(before, workload, args.repeats,
                             lambda line: print(line, file=sys.stderr, flush=True))
    except RevisionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(render(result, args.rev))
    return 0 if all(_parity(result, arm, f"{arm}@{args.rev}") == "the same"
                    for arm in COMPARED) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
