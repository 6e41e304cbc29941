"""The training-curves PNG written at the end of every run."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

from handlers.history import RunHistory  # noqa: E402


def plot_curves(history: RunHistory, path: Path, title: str) -> None:
    """Three panels on the optimizer-step axis: loss (train, val), val accuracy, learning rate."""
    fig, (loss_ax, acc_ax, lr_ax) = plt.subplots(1, 3, figsize=(15, 4))
    train, val = history.train, history.val
    loss_ax.plot(train["step"], train["loss"], label="train (interval mean)")
    if "loss" in val:
        loss_ax.plot(val["step"], val["loss"], "o-", label="validation")
    loss_ax.set(title="loss", xlabel="optimizer step", yscale="log")
    loss_ax.legend()
    if "accuracy" in val:
        acc_ax.plot(val["step"], [100 * a for a in val["accuracy"]], "o-")
    acc_ax.set(title="validation accuracy (%)", xlabel="optimizer step")
    lr_ax.plot(train["step"], train["lr"])
    lr_ax.set(title="learning rate", xlabel="optimizer step")
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
