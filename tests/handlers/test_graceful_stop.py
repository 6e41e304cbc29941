import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from torch import nn

from engine.trainer import create_trainer
from handlers.graceful_stop import GracefulStop

REPO = Path(__file__).resolve().parents[2]
BATCHES_PER_EPOCH = 8  # with accum_steps=3 the windows are iterations 1-3, 4-6 and 7-8


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """Whatever a test does, pytest's own handlers are back afterwards."""
    previous = {signum: signal.getsignal(signum)
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _trainer(make_mlp, accum_steps: int = 3):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return create_trainer(model, optimizer, nn.CrossEntropyLoss(), accum_steps=accum_steps)


def _run_with_signal(trainer, batches, signum, at_iteration, event=Events.ITERATION_STARTED):
    """Attach a GracefulStop whose save records the iteration (and checks that the window's
    step was settled before it: the checkpoint must hold its counters), send ``signum`` to this
    process from a handler at ``event`` of ``at_iteration`` (by default as that step starts,
    like a signal arriving mid-step), run two epochs; return (stop, saved iterations)."""
    saved = []

    def save(engine) -> None:
        assert engine.state.optimizer_step == -(-engine.state.iteration // engine.accum_steps)
        saved.append(engine.state.iteration)

    stop = GracefulStop(save)
    stop.attach(trainer)
    trainer.add_event_handler(event(once=at_iteration), lambda: os.kill(os.getpid(), signum))
    try:
        trainer.run(batches, max_epochs=2)
    finally:
        stop.restore()
    return stop, saved


@pytest.mark.parametrize("at_iteration, window_end", [(1, 3), (4, 6), (5, 6), (6, 6), (7, 8),
                                                     (8, 8)])
def test_sigterm_mid_window_saves_once_at_the_window_end_and_stops(
    make_mlp, make_batches, at_iteration, window_end
):
    trainer = _trainer(make_mlp)
    stop, saved = _run_with_signal(trainer, make_batches(BATCHES_PER_EPOCH), signal.SIGTERM,
                                   at_iteration)
    assert saved == [window_end]
    assert trainer.state.iteration == window_end and trainer.state.epoch == 1
    assert trainer.state.optimizer_step == (window_end + 2) // 3  # every window applied
    assert stop.received == signal.SIGTERM and stop.exit_code == 143


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_sigint_exits_130_and_a_schedulers_sigusr1_138(make_mlp, make_batches, signum, code):
    trainer = _trainer(make_mlp, accum_steps=1)
    stop, saved = _run_with_signal(trainer, make_batches(BATCHES_PER_EPOCH), signum, 5)
    assert saved == [5] and trainer.state.iteration == 5
    assert stop.received == signum and stop.exit_code == code


def test_a_signal_after_the_last_iteration_check_stops_at_the_epoch_end(make_mlp, make_batches):
    """Sent at the epoch's last iteration after GracefulStop looked (e.g. during validation):
    caught at EPOCH_COMPLETED, so the next epoch never starts."""
    trainer = _trainer(make_mlp)
    stop, saved = _run_with_signal(trainer, make_batches(BATCHES_PER_EPOCH), signal.SIGTERM,
                                   BATCHES_PER_EPOCH, event=Events.ITERATION_COMPLETED)
    assert saved == [BATCHES_PER_EPOCH] and trainer.state.epoch == 1
    assert stop.exit_code == 143


def test_without_a_signal_nothing_is_saved_and_the_run_completes(make_mlp, make_batches):
    trainer = _trainer(make_mlp)
    saved = []

    def save(engine) -> None:
        assert engine.state.optimizer_step == -(-engine.state.iteration // engine.accum_steps)
        saved.append(engine.state.iteration)

    stop = GracefulStop(save)
    stop.attach(trainer)
    trainer.run(make_batches(BATCHES_PER_EPOCH), max_epochs=2)
    stop.restore()
    assert saved == [] and stop.received is None and stop.exit_code is None
    assert trainer.state.iteration == 2 * BATCHES_PER_EPOCH


def test_restore_puts_the_previous_handlers_back(make_mlp):
    def previous_term(signum, frame):
        pass

    def previous_int(signum, frame):
        pass

    signal.signal(signal.SIGTERM, previous_term)
    signal.signal(signal.SIGINT, previous_int)
    stop = GracefulStop(lambda engine: None)
    stop.attach(_trainer(make_mlp))
    assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    assert signal.getsignal(signal.SIGINT) == stop._on_signal
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) is previous_term
    assert signal.getsignal(signal.SIGINT) is previous_int


def test_a_second_signal_hands_it_to_the_previous_handler_at_once(make_mlp, make_batches):
    """Ctrl-C twice: the second one goes to whatever handled it before (here a recorder),
    and the handlers are restored; the first one still stops at the window end."""
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    trainer = _trainer(make_mlp)
    saved = []

    def save(engine) -> None:
        assert engine.state.optimizer_step == -(-engine.state.iteration // engine.accum_steps)
        saved.append(engine.state.iteration)

    stop = GracefulStop(save)
    stop.attach(trainer)

    @trainer.on(Events.ITERATION_STARTED(once=4))
    def press_ctrl_c_twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    trainer.run(make_batches(BATCHES_PER_EPOCH), max_epochs=1)
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is not stop._on_signal
    assert saved == [6] and stop.exit_code == 130


def test_save_must_be_callable():
    with pytest.raises(ValueError, match="save must be callable"):
        GracefulStop("last.pt")


SECOND_CTRL_C = """
import os, signal, sys
import torch
from ignite.engine import Events
from torch import nn
from engine.trainer import create_trainer
from handlers.graceful_stop import GracefulStop
from recipes.runner.console import speak_for_libraries

speak_for_libraries()  # what the command line installs: the handler's lines in its voice
model = nn.Linear(4, 2)
trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         nn.CrossEntropyLoss())
GracefulStop(lambda engine: None).attach(trainer)

@trainer.on(Events.ITERATION_STARTED(once=2))
def press_ctrl_c_twice():
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    print("not reached")

trainer.run([(torch.randn(3, 4), torch.tensor([0, 1, 0]))] * 4, max_epochs=1)
"""


def test_a_second_ctrl_c_under_pythons_own_handler_ends_in_one_line(tmp_path):
    """Not an 87-line KeyboardInterrupt traceback: one line, and the process ends by SIGINT
    (a shell's 130)."""
    # SIGINT's default disposition, as under a terminal: a job started in the background
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    done = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == -signal.SIGINT
    assert done.stderr == "warning: SIGINT again: stopping at once\n"
    assert "send it again to stop at once" in done.stdout and "not reached" not in done.stdout
