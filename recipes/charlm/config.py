"""The charlm recipe's keys: its ``Config``, read by ``python -m recipes charlm`` before
torch loads (no torch here)."""

from dataclasses import dataclass

from recipes.common.optimizer_choice import OptimizerChoice
from recipes.runner.config.command_line import field
from recipes.runner.config.run_keys import RunConfig

STDLIB = "stdlib"  # --text: the standard library's own .py files


@dataclass
class Config(OptimizerChoice, RunConfig):
    epochs: int = field(4, "epochs to train (each reads the training text once)", min=1)
    batch_size: int = field(16, "global batch size (windows per micro-batch)", min=1,
                            fixed_on_resume=True)
    lr: float = field(2e-3, "peak learning rate", min=0, min_exclusive=True)
    max_grad_norm: float | None = field(1.0, "clip the global gradient norm (none: no clip)",
                                        min=0, min_exclusive=True)
    text: str = field(STDLIB, "a file or a folder of files; stdlib: the standard library's "
                      ".py files (no tests, no site-packages)")
    val_fraction: float = field(0.1, "files held out for validation", min=0, max=0.5,
                                min_exclusive=True)
    max_train_bytes: int = field(1_000_000, "training text cap (bytes)", min=1)
    max_val_bytes: int = field(50_000, "validation text cap (bytes)", min=1)
    block_size: int = field(128, "context length in bytes", min=1, fixed_on_resume=True)
    n_layer: int = field(4, "transformer blocks", min=1, fixed_on_resume=True)
    n_head: int = field(4, "attention heads", min=1, fixed_on_resume=True)
    n_embd: int = field(128, "embedding width", min=1, fixed_on_resume=True)
    dropout: float = field(0.0, "dropout", min=0, max=0.9)
    weight_decay: float = field(0.1, "weight decay (decoupled) of the weight matrices and "
                                "embeddings, not of biases and norms", min=0,
                                fixed_on_resume=True)
    optimizer: str = field(
        "adamw", "adamw: AdamW for every weight; muon: Muon (momentum orthogonalised by "
        "Newton-Schulz) for the attention and MLP matrices, AdamW for the rest (the embeddings "
        "and tied output layer, norms, biases)", choices=("adamw", "muon"),
        fixed_on_resume=True)
    muon_lr: float = field(0.02, "peak LR of the Muon matrices (--optimizer muon)", min=0,
                           min_exclusive=True, fixed_on_resume=True)
    muon_momentum: float = field(0.95, "momentum of the Muon matrices (Nesterov)", min=0,
                                 max=0.999, fixed_on_resume=True)
