"""``--optimizer <the recipe's own>|muon`` and Muon's own keys, mixed into a recipe's
``Config``; ``recipes.common.optimizers`` builds what they choose. No torch here: the
command line is checked before torch loads."""

from dataclasses import dataclass

from recipes.runner.config.command_line import field


@dataclass
class OptimizerChoice:
    """Run keys of a recipe that may train its hidden weights with Muon instead of its own
    optimizer; mix it into the recipe's ``Config``. A recipe whose own optimizer is not SGD
    declares ``optimizer`` again with its choices (``("adamw", "muon")``)."""

    optimizer: str = field(
        "sgd", "sgd: SGD for every weight; muon: Muon (momentum orthogonalised by "
        "Newton-Schulz) for the conv filters and hidden weight matrices, SGD for the rest "
        "(biases, norm shifts, the output layer)", choices=("sgd", "muon"),
        fixed_on_resume=True)
    # Tuned at batch 256 on CIFAR-10 (3 epochs: 0.04 / 0.85 87.79%, 0.08 / 0.6 87.69%);
    # airbench94_muon's 0.24 / 0.6 is for batch 2000, eight times fewer steps.
    muon_lr: float = field(0.04, "peak LR of the Muon weights (their step size relative to "
                           "the weight's size; --optimizer muon)", min=0, min_exclusive=True,
                           fixed_on_resume=True)
    muon_momentum: float = field(0.85, "momentum of the Muon weights (Nesterov)", min=0,
                                 max=0.999, fixed_on_resume=True)
