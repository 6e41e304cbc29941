"""Byte-level GPT language model (nanoGPT-style) on text files; default: Python's own stdlib.

The text and its split by file come from ``recipes.charlm.text``, encoded once to a
memory-mapped file by ``recipes.charlm.encoded``; the model from ``recipes.charlm.model``.
Samples are windows of ``block_size + 1`` bytes; each training window is shifted by an offset
drawn from (seed, epoch, index), so the order stays resumable. AdamW, or
Muon for the attention and MLP matrices (``--optimizer``); weight decay as nanoGPT's: on every
weight matrix and embedding (the tied output layer included), not on biases and norms. At the
end a sample of generated text is printed.
"""

import logging
import math
from dataclasses import dataclass

import torch
from ignite.engine import Events
from ignite.metrics import Loss, MetricsLambda
from torch.nn import functional as F
from torch.utils.tensorboard import SummaryWriter

from recipes.charlm.config import Config
from recipes.charlm.encoded import encoded_path, load_encoded
from recipes.charlm.model import GPT
from recipes.charlm.text import cap, split_text
from recipes.common.data_order import IndexBatches, OrderedBatches
from recipes.common.optimizers import build_optimizer
from recipes.runner.api import Context, Parts, Recipe
from recipes.runner.config.command_line import ConfigError, DataError
from recipes.runner.training.strategy import is_sharded

logger = logging.getLogger(__name__)

SAMPLE_PROMPT, SAMPLE_BYTES = b"def ", 200  # the text generated at the end


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor
    windows: tuple[int, int]  # (training, validation)
    facts: dict  # the fingerprint


def load_data(config: Config) -> Corpus:
    if config.n_embd % config.n_head:
        raise ConfigError(f"--n-embd {config.n_embd} must be divisible by --n-head {config.n_head}")
    parts = split_text(config.text, config.val_fraction)
    train, val = cap(parts.train, config.max_train_bytes), cap(parts.val, config.max_val_bytes)
    n_train, n_val = (sum(segment.length for segment in part) for part in (train, val))
    span = config.block_size  # a training window's slot leaves room for its shift
    windows = (n_train - 1) // span - 1, (n_val - 1) // span
    if windows[0] < config.batch_size or windows[1] < 1:
        raise DataError(f"--text {config.text}: too little text ({n_train} training, "
                        f"{n_val} validation bytes) for {config.batch_size} windows of "
                        f"{span + 1} bytes (--batch-size, --block-size)")
    path = encoded_path(config.text, config.val_fraction, config.max_train_bytes,
                        config.max_val_bytes)
    encoded = load_encoded(path, train, val)  # memory-mapped: read as the windows need it
    facts = {"version": 1, "kind": "text", "files": parts.files, "train_bytes": n_train,
             "val_bytes": n_val, "sha256": encoded.sha256}
    return Corpus(encoded.train, encoded.val, windows, facts)


def next_byte_logits(model: GPT, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, 256] in fp32, targets [N]): each byte of a window predicts the next."""
    return model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten()


def build(config: Config, corpus: Corpus, ctx: Context) -> Parts:
    span = config.block_size

    def shifted_window(index: int, generator: torch.Generator) -> torch.Tensor:
        start = index * span + int(torch.randint(span, (1,), generator=generator))
        return corpus.train[start:start + span + 1]

    val_windows = [corpus.val[i * span:(i + 1) * span + 1] for i in range(corpus.windows[1])]
    model = GPT(256, span, config.n_layer, config.n_head, config.n_embd, config.dropout,
                activation_checkpointing=config.activation_checkpointing).to(ctx.device)
    train_model = ctx.distribute(model)  # saved: model (FSDP shards it in place)
    optimizer = build_optimizer(config, model, own="adamw", normalize=False, lr=config.lr,
                                betas=(0.9, 0.99))  # nanoGPT's betas for small batches

    def write_sample(trainer) -> None:
        prompt = torch.tensor([list(SAMPLE_PROMPT)], device=ctx.device)
        generator = torch.Generator().manual_seed(config.seed)  # leaves the run's RNG alone
        sample = model.eval().generate(prompt, SAMPLE_BYTES, generator)[0].tolist()
        if ctx.rank != 0:
            return
        text = bytes(sample).decode("utf-8", errors="replace")
        logger.info("sample:\n%s", text)
        with SummaryWriter(ctx.run_dir) as writer:
            writer.add_text("sample", f"```\n{text}\n```", trainer.state.iteration)

    def attach_sample(trainer, evaluator, plan) -> dict:
        if ctx.rank == 0 or is_sharded(model):  # only rank 0 writes; FSDP's forwards need all
            trainer.add_event_handler(Events.COMPLETED, write_sample)
        return {}

    loss = Loss(F.cross_entropy, device=ctx.device)
    return Parts(
        model=model, train_model=train_model, optimizer=optimizer,
        metrics={"loss": loss, "perplexity": MetricsLambda(math.exp, loss)},
        train_batches=IndexBatches(range(corpus.windows[0]), config.batch_size,
                                   seed=config.seed, rank=ctx.rank, world_size=ctx.world_size,
                                   transform=shifted_window),
        val_batches=OrderedBatches(val_windows, config.batch_size, rank=ctx.rank,
                                   world_size=ctx.world_size),
        forward=lambda model, batch: F.cross_entropy(*next_byte_logits(model, batch)),
        predict=next_byte_logits, attach_extra=attach_sample, num_classes=256,
        model_flops=model.training_flops_per_sample(), tokens_per_sample=span,  # bytes
        # Bytes travel as uint8 (8x less to copy) and become token ids on the device.
        prepare_batch=lambda batch, device, non_blocking: batch.to(
            device, non_blocking=non_blocking).long())


RECIPE = Recipe(
    name="charlm", summary=__doc__.splitlines()[0], config=Config, load_data=load_data,
    build=build, metrics={"loss": "min", "perplexity": "min"}, best="loss",
    sample_counts=lambda corpus: corpus.windows, fingerprint=lambda corpus: {"text": corpus.facts},
    commands="recipes.charlm.commands", activation_checkpointing=True,
    blocks=lambda model: list(model.transformer.h))
