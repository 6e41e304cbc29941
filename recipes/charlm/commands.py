"""charlm's commands besides training and ``evaluate``: ``generate``, text from a trained model
(nanoGPT's ``sample.py``: a prompt, samples of new bytes, temperature, top-k, a seed), and
``export``."""

import argparse

import torch
from torch.export import Dim

from recipes.runner.api import Recipe
from recipes.runner.commands.command_parser import CommandParser, positive_int, seed_int, utf8_text
from recipes.runner.commands.export import Exportable, export_command
from recipes.runner.commands.trained import Trained, load_trained
from recipes.runner.config.command_line import ConfigError

VOCABULARY = 256  # bytes


def positive_float(text: str) -> float:
    """An argument type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def generate(recipe: Recipe, args: list[str]) -> int:
    """Print ``--num-samples`` continuations of ``--prompt``; the same seed gives the same
    text. Bytes that are not UTF-8 print as U+FFFD."""
    parser = CommandParser(recipe, "generate", "Text from a trained charlm model: the prompt "
                           "and its continuation, one sample after another.")
    parser.add_argument("--prompt", required=True, type=utf8_text,
                        help="the text to continue (UTF-8)")
    parser.add_argument("--max-new-bytes", type=positive_int, default=200,
                        help="bytes generated per sample (default 200)")
    parser.add_argument("--temperature", type=positive_float, default=0.8,
                        help="softmax temperature, > 0 (default 0.8; lower: more likely bytes)")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help=f"sample from the K likeliest bytes only (default: all "
                        f"{VOCABULARY})")
    parser.add_argument("--num-samples", type=positive_int, default=1,
                        help="how many samples (default 1)")
    parser.add_argument("--seed", type=seed_int, default=None,
                        help="seed of the sampling, 0 to 2**64 - 1 (default: the run's --seed)")
    options = parser.parse_args(args)
    prompt = options.prompt.encode("utf-8")
    if not prompt:
        raise ConfigError("generate: --prompt must not be empty")
    trained = load_trained(recipe, options.source, options.checkpoint, options.device)
    seed = trained.config.seed if options.seed is None else options.seed
    generator = torch.Generator().manual_seed(seed)  # one stream for all the samples
    start = torch.tensor([list(prompt)], device=trained.device)
    for index in range(options.num_samples):
        if index:
            print("-" * 40)
        tokens = trained.parts.model.generate(start, options.max_new_bytes, generator,
                                              options.temperature, options.top_k)
        print(bytes(tokens[0].tolist()).decode("utf-8", errors="replace"))
    return 0


def rebuild_facts(trained: Trained) -> dict:
    """``recipes.charlm.model.GPT(vocab_size, block_size, n_layer, n_head, n_embd)``; its
    input is byte values as int64 ids, at most ``block_size`` of them."""
    config = trained.config
    return {"model": "GPT", "vocab_size": VOCABULARY, "block_size": config.block_size,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd}


def batch_and_time(trained: Trained) -> dict[int, Dim]:
    return {0: Dim("batch", min=1), 1: Dim("time", min=1, max=trained.config.block_size)}


# A validation window holds block_size + 1 bytes: the model sees all but the last.
COMMANDS = {"generate": generate,
            "export": export_command(Exportable(lambda batch: batch[:, :-1], rebuild_facts,
                                                batch_and_time))}
