"""``--profile START:STOP`` end to end on charlm's tiny run: the trace in the run folder, the
table printed, and bad windows refused before anything is written."""

import gzip
import json

import pytest

from recipes.__main__ import main
from tests.helpers import CHARLM, one_error_line, write_text


def test_a_profiled_run_writes_a_chrome_trace_and_prints_the_top_operators(tmp_path, capsys):
    text, run_dir = write_text(tmp_path / "corpus.txt"), tmp_path / "run"
    assert main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir), "--epochs", "1",
                 "--profile", "1:3"]) == 0
    trace_file = run_dir / "profile" / "trace-steps-2-3.json.gz"
    trace = json.loads(gzip.decompress(trace_file.read_bytes()))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names
    out = capsys.readouterr().out.splitlines()
    headings = [line for line in out if line.startswith("profile: ")]
    assert len(headings) == 1 and headings[0].startswith(
        f"profile: optimizer steps 2-3 in {trace_file} ")
    table = out[out.index(headings[0]) + 1:][:10]
    assert all(" ms " in line and " calls  " in line for line in table)


def test_without_profile_no_profiler_is_attached(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    assert main([*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run"),
                 "--describe"]) == 0
    assert "StepProfiler" not in capsys.readouterr().out
    assert main([*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run"),
                 "--describe", "--profile", "2:4"]) == 0
    assert "StepProfiler._on_step" in capsys.readouterr().out


@pytest.mark.parametrize(("window", "named"), [
    ("10:5", "0 <= START < STOP"), ("abc", "START:STOP"), ("0:0", "0 <= START < STOP"),
    ("-1:3", "START:STOP"), ("1:100000", "the window must end by step"),
])
def test_a_bad_window_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, window, named):
    text, run_dir = write_text(tmp_path / "corpus.txt"), tmp_path / "run"
    code = main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir), "--epochs", "2",
                 f"--profile={window}"])
    one_error_line(code, capsys.readouterr().err, "--profile", named)
    assert not run_dir.exists()


def test_a_window_past_a_one_epoch_run_names_its_length_in_words(tmp_path, capsys):
    text, run_dir = write_text(tmp_path / "corpus.txt"), tmp_path / "run"
    code = main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir), "--epochs", "1",
                 "--profile=1:100000"])
    one_error_line(code, capsys.readouterr().err, "--profile", "optimizer steps (1 epoch);")
