import shutil

import pytest

from benchmarks.harness import timing
from benchmarks.harness.timing import WindowTimer
from benchmarks.tools import instructions


def test_the_window_count_is_the_dumps_summary_line():
    dump = "version: 1\ncmd: python\npart: 1\nsummary: 363360317\ntotals: 363360552\n"
    assert instructions.window_instructions(dump) == 363360317
    with pytest.raises(ValueError, match="summary"):
        instructions.window_instructions("totals: 5\n")


def test_the_table_gives_each_arm_per_iteration_and_over_the_tuned_loop():
    text = instructions.render({"hand-tuned": 300_000_000, "trainer": 330_000_000}, 300)
    assert "| `hand-tuned` | 1000.0 | - |" in text
    assert "| `trainer` | 1100.0 | +100.0 |" in text


def test_window_listeners_hear_the_windows_edges_only(monkeypatch):
    heard = []
    monkeypatch.setattr(timing, "window_listeners", [heard.append])
    timer = WindowTimer(warmup=2, timed=3)
    for done in range(1, 7):
        timer.mark(done)
        heard.append(done)
    assert heard == [1, "open", 2, 3, 4, "close", 5, 6]


def test_missing_valgrind_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert instructions.main(["--arms", "trainer"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "valgrind" in err


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--arms", "nope"], "unknown arm(s) ['nope']; allowed: hand, hand-tuned"),
    (["--arms", "lightning"], "unknown arm(s) ['lightning']"),
    (["--iterations", "0"], "--iterations must be >= 1, got 0"),
])
def test_bad_arguments_exit_2_naming_what_is_allowed(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        instructions.main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None
                    or not instructions.CALLGRIND_HEADER.is_file(),
                    reason="needs valgrind, cc and callgrind.h")
def test_counts_a_real_window_under_valgrind(tmp_path):
    marker = instructions.build_marker(tmp_path)
    short = instructions.count("hand-tuned", 10, marker, tmp_path)
    # The tiny model's step is about a million instructions; a count of the whole process
    # (imports included) would be thousands of times more.
    assert 10 * 2e5 < short < 10 * 1e7
