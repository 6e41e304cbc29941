"""One exit table: docs/reference.md lists each of ``ExitCode``'s codes by name, and its
signal codes are the ones the graceful stop reports."""

import re
import signal
from pathlib import Path

from handlers.graceful_stop import EXIT_CODES
from recipes.runner.config.command_line import ExitCode

REPO = Path(__file__).resolve().parents[4]


def test_the_reference_table_lists_every_exit_code_by_its_name():
    text = (REPO / "docs" / "reference.md").read_text().split("## Exit codes", 1)[1]
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", text, re.MULTILINE))
    assert rows == {str(code.value): code.name for code in ExitCode}


def test_the_signal_codes_are_the_graceful_stops():
    assert EXIT_CODES == {signal.SIGINT: ExitCode.INTERRUPTED,
                          signal.SIGTERM: ExitCode.TERMINATED,
                          signal.SIGUSR1: ExitCode.PREEMPTED}

