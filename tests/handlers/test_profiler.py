"""``StepProfiler`` on a scripted engine whose iteration n is optimizer step n, marked in the
trace as ``step<n>``: the window holds exactly its steps, the trace is Chrome's JSON."""

import gzip
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from torch.profiler import record_function

from engine.events import TrainEvents
from handlers.profiler import StepProfiler

REPO = Path(__file__).resolve().parents[2]


class Said(logging.Handler):
    """The lines the profiler logs, while attached (``with Said() as said``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("handlers.profiler")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += record.getMessage().splitlines()

    def __enter__(self) -> "Said":
        self._level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *_) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)


def scripted_trainer(resume_at: int = 0) -> Engine:
    """Each iteration does a little work as ``step<n>`` and fires ``OPTIMIZER_STEP``;
    ``resume_at`` starts the step counter there, as a resumed run does."""
    def step(engine: Engine, _) -> None:
        engine.state.optimizer_step += 1
        with record_function(f"step{engine.state.optimizer_step}"):
            torch.ones(8, 8).mm(torch.ones(8, 8))
        engine.fire_event(TrainEvents.OPTIMIZER_STEP)

    trainer = Engine(step)
    trainer.register_events(*TrainEvents)
    trainer.add_event_handler(Events.STARTED,
                              lambda engine: setattr(engine.state, "optimizer_step", resume_at))
    return trainer


def profiled(tmp_path, start: int, stop: int, steps: int, resume_at: int = 0):
    """(the steps marked in the trace, the logged lines, the handler, the trainer)."""
    trainer = scripted_trainer(resume_at)
    profiler = StepProfiler(start, stop, tmp_path / "profile")
    profiler.attach(trainer)
    with Said() as said:
        trainer.run(range(steps - resume_at), max_epochs=1)
    trace = json.loads(gzip.decompress(profiler.trace_path.read_bytes()))
    marked = sorted(int(event["name"][4:]) for event in trace["traceEvents"]
                    if event.get("name", "").startswith("step"))
    return marked, said.lines, profiler, trainer


def test_the_trace_holds_the_window_steps_and_the_top_operators_are_printed_once(tmp_path):
    marked, lines, profiler, trainer = profiled(tmp_path, start=2, stop=5, steps=8)
    assert marked == [3, 4, 5]
    trace = tmp_path / "profile" / "trace-steps-3-5.json.gz"
    assert profiler.trace_path == trace
    assert lines[0].startswith(f"profile: optimizer steps 3-5 in {trace} ")
    shown = len(lines) - 1  # at most 10, as many as the steps ran
    assert 0 < shown <= 10 and f"top {shown} operators by self CPU time" in lines[0]
    assert any(line.endswith("aten::mm") for line in lines[1:])
    # Done: nothing of it runs at the later steps.
    assert profiler.done
    assert not trainer.has_event_handler(profiler._on_step, TrainEvents.OPTIMIZER_STEP)


def test_a_window_from_zero_opens_as_the_run_starts(tmp_path):
    marked, lines, _, _ = profiled(tmp_path, start=0, stop=2, steps=4)
    assert marked == [1, 2]
    assert lines[0].startswith("profile: optimizer steps 1-2 ")


def test_a_run_that_ends_inside_the_window_writes_what_it_holds(tmp_path):
    marked, lines, _, _ = profiled(tmp_path, start=3, stop=10, steps=5)
    assert marked == [4, 5]
    assert lines[0].startswith("profile: optimizer steps 4-5 ")


def test_a_run_resumed_inside_the_window_profiles_the_rest_of_it(tmp_path):
    marked, _, _, _ = profiled(tmp_path, start=2, stop=6, steps=8, resume_at=4)
    assert marked == [5, 6]


def test_a_run_interrupted_inside_the_window_and_resumed_keeps_both_parts(tmp_path):
    first, _, _, _ = profiled(tmp_path, start=2, stop=6, steps=4)
    rest, _, _, _ = profiled(tmp_path, start=2, stop=6, steps=8, resume_at=4)
    assert (first, rest) == ([3, 4], [5, 6])
    assert sorted(path.name for path in (tmp_path / "profile").iterdir()) == [
        "trace-steps-3-4.json.gz", "trace-steps-5-6.json.gz"]


def test_a_run_resumed_past_the_window_profiles_nothing(tmp_path):
    trainer = scripted_trainer(resume_at=6)
    profiler = StepProfiler(2, 5, tmp_path)
    profiler.attach(trainer)
    trainer.run(range(2), max_epochs=1)
    assert profiler.trace_path is None and not profiler.done
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("start", "stop", "named"), [(-1, 5, "start"), (5, 5, "stop"),
                                                     (5, 3, "stop"), (0.5, 3, "start")])
def test_bad_windows_are_refused(tmp_path, start, stop, named):
    with pytest.raises(ValueError, match=f"^{named} must be an int"):
        StepProfiler(start, stop, tmp_path)


def test_each_window_step_is_marked_profiler_step_n_around_its_work(tmp_path):
    trainer = scripted_trainer()
    profiler = StepProfiler(2, 5, tmp_path)
    profiler.attach(trainer)
    trainer.run(range(8), max_epochs=1)
    events = json.loads(gzip.decompress(profiler.trace_path.read_bytes()))["traceEvents"]
    spans = {event["name"]: (event["ts"], event["ts"] + event["dur"]) for event in events
             if event.get("name", "").startswith(("ProfilerStep#", "step"))}
    assert sorted(name for name in spans if name.startswith("ProfilerStep#")) == [
        "ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    for n in (3, 4, 5):
        (begin, end), (work_begin, work_end) = spans[f"ProfilerStep#{n}"], spans[f"step{n}"]
        assert begin <= work_begin and work_end <= end


def test_the_printed_table_lists_operators_not_the_step_markers(tmp_path):
    def step(engine: Engine, _) -> None:  # time outside any operator is the marker's own
        engine.state.optimizer_step += 1
        time.sleep(0.05)
        torch.ones(8, 8).mm(torch.ones(8, 8))
        engine.fire_event(TrainEvents.OPTIMIZER_STEP)

    trainer = Engine(step)
    trainer.register_events(*TrainEvents)
    trainer.add_event_handler(Events.STARTED,
                              lambda engine: setattr(engine.state, "optimizer_step", 0))
    StepProfiler(0, 3, tmp_path).attach(trainer)
    with Said() as said:
        trainer.run(range(4), max_epochs=1)
    table = said.lines[1:]
    assert any(line.endswith("aten::mm") for line in table)
    assert not any("ProfilerStep" in line for line in table)


def test_a_cpu_window_leaves_no_kineto_lines_on_stderr(tmp_path):
    """A CUDA build of torch on a machine without a GPU (this one: the suite's) had kineto
    print ``ERROR ... gpuGetDeviceCount failed with code 35`` and ``profiler_start`` lines.
    In a fresh process: kineto reads its log level once, when the first profiler starts."""
    script = ("import sys; sys.path.insert(0, sys.argv[1])\n"
              "from tests.handlers.test_profiler import profiled\n"
              "from pathlib import Path\n"
              "profiled(Path(sys.argv[2]), 1, 3, 4)\n")
    environment = {key: value for key, value in os.environ.items()
                   if key != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script, str(REPO), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "profile").glob("trace-steps-*.json.gz")) and done.stderr == ""
