"""The training-curves PNG written at the end of every run."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

from handlers.history import RunHistory  # noqa: E402


def plot_curves(history: RunHistory, path: Path, title: str) -> None:
    """Panels on the optimizer-step axis: loss (train, and validation when the recipe
    reports a ``loss``), each other validation metric of ``history.modes``, learning rate."""
    train, val = history.train, history.val
    others = [name for name in history.modes if name != "loss"]
    fig, axes = plt.subplots(1, 2 + len(others), figsize=(5 * (2 + len(others)), 4))
    loss_ax, lr_ax = axes[0], axes[-1]
    loss_ax.plot(train["step"], train["loss"], label="train (interval mean)")
    if "loss" in val:
        loss_ax.plot(val["step"], val["loss"], "o-", label="validation")
    loss_ax.set(title="loss", xlabel="optimizer step", yscale="log")
    loss_ax.legend()
    for name, ax in zip(others, axes[1:-1], strict=True):
        if name in val:
            ax.plot(val["step"], val[name], "o-")
        better = "higher" if history.modes[name] == "max" else "lower"
        ax.set(title=f"validation {name} ({better} is better)", xlabel="optimizer step")
    lr_ax.plot(train["step"], train["lr"])
    lr_ax.set(title="learning rate", xlabel="optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
