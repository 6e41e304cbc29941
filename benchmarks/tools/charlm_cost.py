"""What a charlm run costs, from its own ``summary.json``: bytes (tokens) per second and peak
memory per process, for settings side by side.

``python -m benchmarks.tools.charlm_cost --arm NAME="ARGS" --arm NAME="ARGS" ... [--repeats 3]``
runs ``python -m recipes charlm ARGS`` once per arm and repeat, the arms in turn (A B A B ...:
a drift of the machine's speed touches every arm alike), each in a fresh process group and run
folder, and prints per arm the median and range of bytes/s per device, seconds per optimizer
step, and the peak memory of each process (CUDA: the allocator's peak; CPU: the peak RSS, which
includes the interpreter, the libraries and the text). ``--common`` holds the arguments every
arm shares. Nothing is written outside a temporary folder.

Example (activation checkpointing on and off at one width)::

    python -m benchmarks.tools.charlm_cost --repeats 3 \\
        --common "--n-embd 256 --block-size 256 --batch-size 16 --epochs 1" \\
        --arm "plain=" --arm "checkpointed=--activation-checkpointing true"
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TIMEOUT_SEC = 1800  # one run
MB = 2**20


def run_once(args: list[str], folder: Path, text: Path | None) -> dict:
    """One charlm run in ``folder``; its summary."""
    run_dir = folder / "run"
    command = [sys.executable, "-m", "recipes", "charlm", *args, "--run-dir", str(run_dir),
               "--progress", "off", "--resume", "never"]
    if text is not None:
        command += ["--text", str(text)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SEC)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {result.returncode}:\n"
                           f"{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def spread(values: list[float], form: str) -> str:
    return (f"{format(statistics.median(values), form)} "
            f"({format(min(values), form)}-{format(max(values), form)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.charlm_cost",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", action="append", required=True,
                        help='NAME="charlm arguments" (give two or more)')
    parser.add_argument("--common", default="", help="arguments every arm shares")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", type=Path, default=None,
                        help="the text (default: the recipe's, the standard library)")
    options = parser.parse_args(argv)
    arms = dict(arm.split("=", 1) for arm in options.arm)
    results: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(options.repeats):
            for name, args in arms.items():
                where = Path(folder, f"{name}-{repeat}")
                where.mkdir()
                summary = run_once(shlex.split(options.common) + shlex.split(args), where,
                                   options.text)
                results[name].append(summary)
                print(f"{name} #{repeat + 1}: {summary['tokens_per_sec_per_device']:.0f} "
                      f"bytes/s per device, peak "
                      f"{[round(size / MB) for size in summary['peak_memory_bytes_per_process']]}"
                      f" MB", file=sys.stderr, flush=True)
    print(f"common: {options.common}")
    print("| arm | bytes/s per device | s per step | peak memory per process, MB | source |")
    print("|---|---|---|---|---|")
    for name, summaries in results.items():
        rates = [summary["tokens_per_sec_per_device"] for summary in summaries]
        steps = [summary["train_time_sec"] / summary["optimizer_steps"] for summary in summaries]
        peaks = [summary["peak_memory_bytes_per_process"] for summary in summaries]
        per_process = ", ".join(spread([peak[rank] / MB for peak in peaks], ".0f")
                                for rank in range(len(peaks[0])))
        print(f"| {name} `{arms[name]}` | {spread(rates, '.0f')} | {spread(steps, '.3f')} | "
              f"{per_process} | {summaries[0]['peak_memory_source']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
