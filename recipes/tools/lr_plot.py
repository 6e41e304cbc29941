"""Plot the six named LR schedules over the same run, side by side, into one PNG.

No training: each schedule comes from ``build_scheduler`` (the builder recipes use)
on a dummy optimizer and is stepped on its own clock; ``plateau`` reads a scripted
validation loss that improves for half the run and then stalls.

    python -m recipes.tools.lr_plot --out runs/lr_schedules.png --epochs 10 --steps-per-epoch 100
"""

import argparse
from pathlib import Path

import torch
from matplotlib.figure import Figure

from handlers.lr_scheduling import LRSchedulerHandler, build_scheduler

PEAK_LR = 0.1
# Options that make each schedule's shape visible on a short run.
PLOT_OPTIONS = {
    "step": {"gamma": 0.5},
    "cosine": {},
    "onecycle": {},
    "plateau": {"metric": "val_loss", "factor": 0.5, "patience": 1},
    "cosine_restarts": {"T_mult": 2},
    "warmup_cosine": {"min_lr_ratio": 0.1},
}


def scripted_val_loss(epoch: int, epochs: int) -> float:
    """Improves by the same amount each epoch for the first half of the run, then flat."""
    return 1.0 - min(epoch, epochs // 2) / epochs


def lr_curve(handler: LRSchedulerHandler, epochs: int, steps_per_epoch: int) -> list[float]:
    """The LR of every optimizer step, stepping the scheduler as the trainer would."""
    optimizer, lrs = handler.scheduler.optimizer, []
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            lrs.append(handler.current_lr)
            optimizer.step()  # no gradients: changes nothing, keeps torch's step order
            if handler.clock == "step":
                handler.scheduler.step()
        if handler.clock == "epoch":
            handler.scheduler.step()
        elif handler.clock == "metric":
            handler.scheduler.step(scripted_val_loss(epoch, epochs))
    return lrs


def plot(out: Path, epochs: int, steps_per_epoch: int) -> Path:
    figure = Figure(figsize=(15, 8), layout="constrained")
    axes = figure.subplots(2, 3, sharex=True).flat
    epoch_axis = [step / steps_per_epoch for step in range(epochs * steps_per_epoch)]
    for ax, (name, options) in zip(axes, PLOT_OPTIONS.items(), strict=True):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK_LR)
        handler = build_scheduler(
            name, optimizer, steps_per_epoch=steps_per_epoch, epochs=epochs,
            warmup_epochs=epochs / 10 if name == "warmup_cosine" else 0.0, **options,
        )
        ax.plot(epoch_axis, lr_curve(handler, epochs, steps_per_epoch))
        ax.set_title(f"{name} (clock: {handler.clock})")
        ax.grid(alpha=0.3)
    figure.suptitle(f"LR schedules: {epochs} epochs x {steps_per_epoch} optimizer steps")
    figure.supxlabel("epoch")
    figure.supylabel("learning rate")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m recipes.tools.lr_plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/lr_schedules.png"))
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--steps-per-epoch", type=positive_int, default=100,
                        help="optimizer steps per epoch (batches / accum_steps, rounded up)")
    args = parser.parse_args(argv)
    out = plot(args.out, args.epochs, args.steps_per_epoch)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
