"""The charlm recipe: its text split, its loss and perplexity, and tiny runs end to end.

Runs go through ``python -m recipes charlm`` in a subprocess (cwd = a temporary folder, so
``runs/`` lands there) on a few small text files the test writes, with a one-block model.
"""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.muon import Muon
from engine.trainer import create_evaluator
from recipes.__main__ import main
from recipes.charlm.model import GPT
from recipes.charlm.recipe import Config, build, load_data, next_byte_logits
from recipes.charlm.text import Segment, TextParts, split_files, split_text
from recipes.runner.api import Context
from tests.helpers import write_text_folder

CLI_TIMEOUT_SEC = 300  # a hung run fails its test instead of hanging the suite
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
              "--batch-size", "8"]
TINY_RUN = [*TINY_MODEL, "--epochs", "2", "--progress", "off", "--device", "cpu"]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes", "charlm", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_SEC)


# --- data --------------------------------------------------------------------------------


def test_split_by_file_is_deterministic_disjoint_and_independent_of_where_the_text_lies():
    names = [f"pkg{index % 7}/module_{index}.py" for index in range(200)]
    train, val = split_files(Path("/a"), [Path("/a", name) for name in names], 0.1)
    again = split_files(Path("/a"), [Path("/a", name) for name in reversed(names)], 0.1)
    elsewhere = split_files(Path("/b/c"), [Path("/b/c", name) for name in names], 0.1)
    assert (train, val) == again
    assert [p.relative_to("/a") for p in train] == [p.relative_to("/b/c") for p in elsewhere[0]]
    assert not set(train) & set(val) and len(train) + len(val) == len(names)
    assert 5 <= len(val) <= 40  # about a tenth


def test_split_of_two_files_keeps_one_for_each_part():
    train, val = split_files(Path("/a"), [Path("/a/x.txt"), Path("/a/y.txt")], 0.1)
    assert len(train) == len(val) == 1


def test_a_single_file_keeps_its_last_tenth_for_validation(tmp_path):
    text = tmp_path / "input.txt"
    text.write_bytes(bytes(range(256)) * 4)
    assert split_text(str(text), 0.1) == TextParts([Segment(text, 0, 922)],
                                                   [Segment(text, 922, 102)], 1)


def test_load_data_counts_windows_and_fingerprints_the_bytes(tmp_path):
    folder = write_text_folder(tmp_path / "text")
    config = Config(text=str(folder), block_size=16, batch_size=8)
    corpus = load_data(config)
    train_bytes, val_bytes = len(corpus.train), len(corpus.val)
    assert corpus.windows == ((train_bytes - 1) // 16 - 1, (val_bytes - 1) // 16)
    assert corpus.facts["files"] == 20 and corpus.facts["train_bytes"] == train_bytes
    assert load_data(config).facts == corpus.facts
    (folder / "module_0.py").write_text("changed")
    assert load_data(config).facts["sha256"] != corpus.facts["sha256"]


def test_training_windows_are_shifted_resumably_and_stay_inside_the_text(tmp_path):
    config = Config(text=str(write_text_folder(tmp_path / "text")), block_size=16,
                    batch_size=8)
    corpus = load_data(config)
    parts = build(config, corpus, Context(torch.device("cpu"), 0, 1, tmp_path))
    first, again = list(parts.train_batches), list(parts.train_batches.epoch_batches(1))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert first[0].shape == (8, 17) and first[0].dtype == torch.uint8
    assert first[0][0].numpy().tobytes() in corpus.train.numpy().tobytes()  # a real window
    assert len(parts.train_batches) == corpus.windows[0] // 8


# --- model, loss, perplexity -------------------------------------------------------------


class UniformLogits(nn.Module):
    """Equal logits for every byte: the loss is ln 256 and the perplexity 256."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, 256)


def test_uniform_logits_give_perplexity_256(tmp_path):
    config = Config(text=str(write_text_folder(tmp_path / "text")), block_size=16, batch_size=8)
    parts = build(config, load_data(config), Context(torch.device("cpu"), 0, 1, tmp_path))
    batch = parts.prepare_batch(next(iter(parts.val_batches)), torch.device("cpu"), False)
    assert parts.forward(UniformLogits(), batch).item() == pytest.approx(math.log(256))
    evaluator = create_evaluator(UniformLogits(), parts.metrics, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    metrics = evaluator.run(parts.val_batches).metrics
    assert metrics["loss"] == pytest.approx(math.log(256))
    assert metrics["perplexity"] == pytest.approx(256)


def test_predict_flattens_every_next_byte_target():
    batch = torch.arange(2 * 5).reshape(2, 5)
    logits, targets = next_byte_logits(GPT(256, 4, 1, 1, 8), batch)
    assert logits.shape == (8, 256) and logits.dtype == torch.float32
    assert targets.tolist() == [1, 2, 3, 4, 6, 7, 8, 9]


def test_the_model_is_causal():
    model = GPT(256, 8, 2, 2, 16).eval()
    idx = torch.randint(0, 256, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 256
    assert torch.equal(model(idx)[0, :5], model(changed)[0, :5])
    assert not torch.equal(model(idx)[0, 5:], model(changed)[0, 5:])


def nanogpt_keys(n_layer: int) -> list[str]:
    """nanoGPT's ``state_dict`` keys for its GPT with ``bias=True`` (GPT-2's layout)."""
    block = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
             "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
             "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    return ["transformer.wte.weight", "transformer.wpe.weight",
            *[f"transformer.h.{layer}.{key}" for layer in range(n_layer) for key in block],
            "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]


def test_state_dict_keys_are_nanogpts_with_the_embedding_tied_to_the_head():
    model = GPT(256, 8, n_layer=2, n_head=2, n_embd=16)
    state = model.state_dict()
    assert list(state) == nanogpt_keys(2)
    assert model.transformer.wte.weight is model.lm_head.weight
    assert state["transformer.wte.weight"].data_ptr() == state["lm_head.weight"].data_ptr()


def test_init_is_gpt2s_with_both_residual_projections_scaled_by_depth():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(256, 64, n_layer=n_layer, n_head=2, n_embd=64)
    parameters = dict(model.named_parameters())
    scaled = {name for name in parameters if name.endswith(("attn.c_proj.weight",
                                                             "mlp.c_proj.weight"))}
    assert len(scaled) == 2 * n_layer
    for name, parameter in parameters.items():
        if name.endswith("bias"):
            assert not parameter.any(), name
        elif ".ln_" in name:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        else:  # thousands of draws each: the std is within a few percent of its target
            std = 0.02 / math.sqrt(2 * n_layer) if name in scaled else 0.02
            assert parameter.std().item() == pytest.approx(std, rel=0.1), name
            assert abs(parameter.mean().item()) < 0.1 * std, name


def named(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


OPTIMIZERS = next(f for f in dataclasses.fields(Config) if f.name == "optimizer").metadata[
    "choices"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_recipes_optimizer_decays_matrices_and_embeddings_not_biases_or_norms(
        optimizer, tmp_path):
    """nanoGPT's rule, on the optimizer ``build`` really gives the trainer: every weight
    matrix and both embeddings (the token one is the tied head) decay; biases and LayerNorm
    weights do not; with Muon the attention and MLP matrices move to the Muon group."""
    config = Config(text=str(write_text_folder(tmp_path / "text")), block_size=16,
                    batch_size=8, n_layer=2, n_head=2, n_embd=16, optimizer=optimizer,
                    weight_decay=0.1)
    parts = build(config, load_data(config), Context(torch.device("cpu"), 0, 1, tmp_path))
    model = parts.model
    matrices = {f"transformer.h.{layer}.{key}.weight" for layer in range(2)
                for key in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    embeddings = {"transformer.wte.weight", "transformer.wpe.weight"}
    norms_and_biases = {f"transformer.h.{layer}.{key}" for layer in range(2)
                        for key in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                                    "attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias",
                                    "mlp.c_proj.bias")}
    norms_and_biases |= {"transformer.ln_f.weight", "transformer.ln_f.bias"}
    expected = {
        "adamw": (torch.optim.AdamW, {"decayed": (embeddings | matrices, 0.1),
                                      "not_decayed": (norms_and_biases, 0.0)}),
        "muon": (Muon, {"decayed": (embeddings, 0.1), "not_decayed": (norms_and_biases, 0.0),
                        "muon": (matrices, 0.1)}),  # Muon's decay: decoupled, unnormalised
    }[optimizer]
    groups = {group["name"]: (named(model, group["params"]), group["weight_decay"])
              for group in parts.optimizer.param_groups}
    assert (type(parts.optimizer), groups) == expected
    every = [p for group in parts.optimizer.param_groups for p in group["params"]]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    if optimizer == "muon":
        assert parts.optimizer.other == "adamw"


# --- the command line --------------------------------------------------------------------


# AdamW in `make test-slow`: the end-to-end path is the same, only the optimizer differs.
@pytest.mark.parametrize("optimizer", [pytest.param("adamw", marks=pytest.mark.slow), "muon"])
def test_tiny_run_end_to_end_then_a_resume_finds_it_complete(optimizer, tmp_path):
    write_text_folder(tmp_path / "text")
    args = ["--text", "text", *TINY_RUN, "--optimizer", optimizer, "--run-name", "tiny"]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "charlm" / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    assert math.exp(summary["best_val_loss"]) == pytest.approx(summary["best_val_perplexity"])
    assert summary["best_val_perplexity"] < 256  # it learned something in 2 epochs
    assert "sample:\ndef " in result.stdout
    assert list(run_dir.glob("events.out.tfevents.*"))
    # Cost on the CPU: bytes (tokens) per second, the model's FLOPs, no MFU, the peak RSS.
    assert summary["tokens_per_sec_per_device"] == pytest.approx(
        16 * summary["samples_per_sec_per_device"], rel=1e-3)
    assert summary["model_flops_per_sample"] == GPT(256, 16, 1, 2, 16).training_flops_per_sample()
    assert summary["mfu"] is None and summary["peak_flops_per_device"] is None
    assert summary["peak_memory_source"] == "process_peak_rss"
    assert summary["peak_memory_bytes"] == summary["peak_memory_bytes_per_process"][0] > 2**20
    again = run_cli(args, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "the run is already complete" in again.stdout


def test_missing_text_exits_2_with_one_line_and_writes_nothing(tmp_path):
    result = run_cli(["--text", "nowhere", *TINY_RUN], tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: --text nowhere: no such file or folder\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("make", "expected"), [
    (lambda root: root.mkdir(), "the folder holds no files"),
    (lambda root: write_text_folder(root, n_files=3, lines_per_file=1), "too little text"),
    (lambda root: (root.mkdir(), (root / "empty.txt").touch()), "too little text"),
])
def test_unusable_text_is_a_user_error(tmp_path, monkeypatch, capsys, make, expected):
    monkeypatch.chdir(tmp_path)
    make(tmp_path / "text")
    before = sorted(tmp_path.rglob("*"))
    assert main(["charlm", "--text", "text", *TINY_RUN]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --text text: ") and expected in error
    assert error.count("\n") == 1
    assert sorted(tmp_path.rglob("*")) == before


def test_n_embd_must_split_into_heads(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_text_folder(tmp_path / "text")
    assert main(["charlm", "--text", "text", "--n-embd", "16", "--n-head", "3"]) == 2
    assert "--n-embd 16 must be divisible by --n-head 3" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
