"""Before and after, side by side: the engine arms of a git revision against the working
tree's, in one process, block by block:
``python -m benchmarks.versus [REV] [--repeats N] [--iterations N]`` (REV: HEAD).

Two ``make bench`` runs taken an hour apart do not compare: this machine's overall speed
moves between runs, and every overhead in µs with it (Ignite's stock trainer, unchanged,
read +59.5 and +79.9 µs in two runs of one evening). Here the revision's ``engine``,
``handlers`` and ``recipes`` packages and its ``benchmarks/arms.py`` and
``benchmarks/recipe_handlers.py`` are exported by ``git archive`` into a temporary
directory as packages of their own (``before_engine``, ...: their import statements are
rewritten), and their ``trainer`` and ``trainer+recipe`` arms run in the same lockstep
rounds as the working tree's and the tuned hand loop (``benchmarks.lockstep``), on the
tiny model of ``make bench``'s section 1. The table gives each arm's overhead over the
tuned loop now and at REV, and now minus REV per paired block: median and 95% interval.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from benchmarks import overhead
from benchmarks.arms import ARMS, ArmResult
from benchmarks.plan import FULL
from benchmarks.report import table
from benchmarks.workloads import Workload, tiny_workload

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "handlers", "recipes")
BENCH_MODULES = ("arms", "recipe_handlers")  # benchmarks/<name>.py, exported with them
COMPARED = {"trainer": "our_trainer", "trainer+recipe": "our_trainer_with_recipe_handlers"}
REFERENCE = overhead.TUNED
PREFIX = "before_"
# ``from X...`` / ``import X...`` of a package that is exported with the revision.
_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)(?P<keyword>from|import)[ \t]+"
    r"(?P<module>(?:engine|handlers|recipes)|benchmarks\.(?:arms|recipe_handlers))(?!\w)"
    r"(?P<rest>.*)$",
    re.MULTILINE,
)


class RevisionError(RuntimeError):
    """The revision cannot be exported or does not have the arms this tool runs."""


def renamed(module: str) -> str:
    """The exported copy's name of ``module`` (``engine`` -> ``before_engine``,
    ``benchmarks.arms`` -> ``before_benchmarks.arms``)."""
    return PREFIX + module


def rewrite_imports(source: str) -> str:
    """``source`` with every import of an exported package pointed at its copy; an
    ``import X.y`` keeps its name ``X`` bound, as before the rewrite."""
    def replace(match: re.Match) -> str:
        indent, keyword, module, rest = match.group("indent", "keyword", "module", "rest")
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


def export_revision(rev: str, into: Path, repo: Path = ROOT) -> None:
    """``rev``'s packages and bench modules under ``into``, renamed and rewritten."""
    paths = [*PACKAGES, *(f"benchmarks/{name}.py" for name in BENCH_MODULES)]
    archive = into / "rev.tar"
    result = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar",
                             f"--output={archive}", rev, *paths],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RevisionError(f"git archive {rev} failed: {result.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    tree = into / "tree"
    for package in PACKAGES:
        (tree / package).rename(into / renamed(package))
    bench = into / f"{PREFIX}benchmarks"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    for name in BENCH_MODULES:
        (tree / "benchmarks" / f"{name}.py").rename(bench / f"{name}.py")
    for path in into.glob(f"{PREFIX}*/**/*.py"):
        path.write_text(rewrite_imports(path.read_text()))


@contextmanager
def revision_arms(rev: str) -> Iterator[dict[str, Callable[[Workload], ArmResult]]]:
    """The revision's compared arms (``"trainer@REV"``, ...), imported from a copy that is
    forgotten again afterwards (modules, path, directory)."""
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp:
        export_revision(rev, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            yield _import_arms(rev)
        finally:
            sys.path.remove(tmp)
            for name in [name for name in sys.modules if name.startswith(PREFIX)]:
                del sys.modules[name]


def _import_arms(rev: str) -> dict[str, Callable[[Workload], ArmResult]]:
    try:
        arms = importlib.import_module(f"{PREFIX}benchmarks.arms")
    except Exception as error:  # any import failure of old code: say which revision
        raise RevisionError(f"{rev}'s benchmarks/arms.py does not import here: "
                            f"{type(error).__name__}: {error}") from error
    missing = [name for name in COMPARED.values() if not hasattr(arms, name)]
    if missing or "blocks" not in getattr(arms.ArmResult, "__dataclass_fields__", {}):
        raise RevisionError(f"{rev}'s benchmarks/arms.py has no {', '.join(missing) or 'blocks'}"
                            ": it predates the arms this tool runs (2026-11-25)")
    return {f"{arm}@{rev}": getattr(arms, function) for arm, function in COMPARED.items()}


def compare(before: dict[str, Callable[[Workload], ArmResult]], workload: Workload,
            repeats: int, log: Callable[[str], None]) -> overhead.OverheadResult:
    """``repeats`` lockstep runs of the tuned loop, the working tree's compared arms and
    ``before``'s. The signal handlers are put back afterwards: two recipe handler sets
    running at once restore each other's graceful-stop handlers out of order."""
    ARMS.update(before)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return overhead.measure(workload, repeats, 1, log,
                                arms=[REFERENCE, *COMPARED, *before])
    finally:
        for name in before:
            del ARMS[name]
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def render(result: overhead.OverheadResult, rev: str) -> str:
    def difference(arm: str, reference: str) -> str:
        return overhead.paired_interval(result, arm, reference, lambda a, r: a - r, 3, 1e6)

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


def _parity(result: overhead.OverheadResult, now: str, before: str) -> str:
    losses = {run.probe_loss for arm in (now, before) for run in result.runs[arm]}
    return "the same" if len(losses) == 1 else f"differs by {max(losses) - min(losses):.1e}"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.versus",
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
