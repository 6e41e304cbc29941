"""An fp16 run resumed from a checkpoint goes on with the loss scaler where it was.

Every other resume test runs fp32, whose scaler is disabled and saves nothing; a resume
that left the GradScaler at its initial scale and growth tracker would pass them all. The
CPU has an fp16 GradScaler (``torch.amp.GradScaler("cpu")``), so this runs anywhere.
"""

from dataclasses import dataclass

import torch
from ignite.engine import Events
from torch import nn

from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import Trainer, create_trainer
from handlers.checkpoint.checkpointer import Checkpointer


def _batches(n_batches: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(n_batches)]


DATA = _batches(5)
# Too high a first scale, and growth every 3 good steps: the first epoch backs off three
# times and ends at 2**17 with 2 good steps towards the next growth, which comes at the
# second epoch's first step and overflows at its second. A scaler back at its defaults
# (2**16, growth after 2000 steps) would step there instead.
FIRST_SCALE, GROWTH_INTERVAL = 2.0**20, 3


@dataclass
class Run:
    model: nn.Module
    trainer: Trainer
    ckpt: Checkpointer
    skipped_at: list[int]


def _build(dirname, seed: int = 0, with_scaler: bool = True, tuned_scaler: bool = True) -> Run:
    """A tiny fp16 model whose Dropout makes the result depend on torch's global RNG."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), precision="fp16")
    if tuned_scaler:
        trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": FIRST_SCALE,
                                        "growth_interval": GROWTH_INTERVAL})
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "rng": RngState()}
    if with_scaler:
        to_save["scaler"] = trainer.scaler
    ckpt = Checkpointer(dirname, to_save, run_id="run-a")
    skipped_at: list[int] = []
    trainer.add_event_handler(TrainEvents.STEP_SKIPPED,
                              lambda engine: skipped_at.append(engine.state.iteration))
    return Run(model, trainer, ckpt, skipped_at)


def _resumed_second_epoch(dirname, **build_kwargs) -> Run:
    """Built with other weights, RNG and a scaler at its defaults until resumed."""
    resumed = _build(dirname, seed=99, tuned_scaler=False, **build_kwargs)
    info = resumed.ckpt.resume("auto")
    assert (info.path.name, info.rejected) == ("last.pt", [])
    resumed.trainer.run(DATA, max_epochs=2)
    return resumed


def test_fp16_one_epoch_then_resume_then_one_epoch_is_bit_identical_to_two_epochs(tmp_path):
    straight = _build(tmp_path / "straight")
    straight.trainer.run(DATA, max_epochs=2)

    first = _build(tmp_path / "ckpt")
    first.trainer.add_event_handler(Events.EPOCH_COMPLETED, first.ckpt.save_last)
    first.trainer.run(DATA, max_epochs=1)
    saved = first.trainer.scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**17, 2)  # the scaler is in play

    resumed = _resumed_second_epoch(tmp_path / "ckpt")

    assert resumed.trainer.scaler.state_dict() == straight.trainer.scaler.state_dict()
    assert resumed.skipped_at == [iteration for iteration in straight.skipped_at
                                  if iteration > len(DATA)] == [len(DATA) + 2]
    assert (resumed.trainer.state.optimizer_step, resumed.trainer.state.skipped_steps) == (
        straight.trainer.state.optimizer_step, straight.trainer.state.skipped_steps)
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name

    # The control: resumed without the scaler, the second epoch takes another course.
    no_scaler = _resumed_second_epoch(tmp_path / "ckpt", with_scaler=False)
    assert no_scaler.skipped_at == []
    assert not torch.equal(straight.model[0].weight, no_scaler.model[0].weight)
