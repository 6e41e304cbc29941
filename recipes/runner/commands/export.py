"""``python -m recipes <recipe> export <run or checkpoint> [--format pt2|safetensors|onnx]``:
the trained model as a file that loads without this project.

``pt2`` (default) is ``torch.export`` of the model in eval mode: its forward without test-time
augmentation, in fp32, on the input the evaluator gives it (normalised images, or byte ids),
with a dynamic batch dimension (and charlm's sequence length up to its block size); it loads
with ``torch.export.load(path).module()`` and needs torch only. That module is already in eval
mode (exported so) and refuses ``.eval()``/``.train()`` (torch's ``NotImplementedError``: an
exported graph has no mode to switch); the JSON says ``"mode": "eval"``. ``safetensors`` is
the weights the run evaluated (the averaged ones with ``--averaging``) in the pickle-free format any
framework reads, to load into the recipe's model class; its metadata carries the JSON's facts
too (each value as JSON text). ``onnx`` is that ``pt2`` program
converted to ONNX, with the same dynamic dimensions, for onnxruntime and other ONNX runtimes;
it needs the optional ``onnx`` extra (``recipes.runner.commands.export_onnx``). Each is written with
``<file>.json`` next to it: what rebuilds the model and prepares its input (model name and
shape keys, class names, normalisation, image size or block size) and the input's shape.

A recipe gives its part in an ``Exportable``: which tensor of a validation batch is the model's
input, which of its dimensions may vary, and its rebuild facts. The files go to
``<run>/export/<checkpoint>.<format>`` (or ``--out``); nothing else is written.
"""

import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch
from torch.export import Dim

from handlers.atomic_write import write_atomically, write_json_atomic
from recipes.runner.api import Recipe
from recipes.runner.commands.command_parser import CommandParser, output_path, writing
from recipes.runner.commands.export_onnx import largest_onnx_difference, require_onnx, to_onnx
from recipes.runner.commands.trained import Trained, load_trained
from recipes.runner.console import say

FORMATS = {"pt2": ".pt2", "safetensors": ".safetensors", "onnx": ".onnx"}
CHECKED_SAMPLES = 256  # of the first validation batch, run through both the model and its export


def batch_dimension(trained: Trained) -> dict[int, Dim]:
    """The dynamic dimensions of an image classifier's input: the batch."""
    return {0: Dim("batch", min=1)}


@dataclass(frozen=True)
class Exportable:
    """A recipe's part of ``export``.

    ``model_input(batch)``: the model's input in a validation batch after ``prepare_batch``
    (e.g. the images of ``(images, labels)``); ``dynamic(trained)``: the dimensions of that
    input that may vary in the export, by index; ``describe(trained)``: what rebuilds the
    model and prepares its input, for the JSON (JSON values only).
    """

    model_input: Callable[[Any], torch.Tensor]
    describe: Callable[[Trained], dict[str, Any]]
    dynamic: Callable[[Trained], dict[int, Dim]] = batch_dimension


def export_command(exportable: Exportable) -> Callable[[Recipe, list[str]], int]:
    """The ``export`` command of a recipe."""

    def export(recipe: Recipe, args: list[str]) -> int:
        # On the CPU unless asked: a CPU program loads anywhere.
        parser = CommandParser(recipe, "export", "The trained model as a file that loads "
                               "without this project, with a JSON of what rebuilds it.",
                               device="cpu")
        parser.add_argument("--format", choices=FORMATS, default="pt2",
                            help="pt2: torch.export program (torch.export.load); safetensors: "
                            "the weights; onnx: the pt2 program as ONNX (needs the onnx extra) "
                            "(default: pt2)")
        parser.add_argument("--out", default=None,
                            help="the file to write (default: <run>/export/<checkpoint>"
                            ".<format>); its JSON goes next to it as <file>.json")
        options = parser.parse_args(args)
        suffix = FORMATS[options.format]
        if options.format == "onnx":
            require_onnx()
        out = None if options.out is None else output_path(options.out, (suffix,))
        trained = load_trained(recipe, options.source, options.checkpoint, options.device)
        if out is None:
            out = trained.run_dir / "export" / f"{trained.checkpoint.stem}{suffix}"
            with writing(out):
                out.parent.mkdir(exist_ok=True)
        inputs = exportable.model_input(first_validation_batch(trained))
        facts = {"recipe": recipe.name, "checkpoint": str(trained.checkpoint),
                 "epoch": trained.meta["epoch"],
                 "optimizer_step": trained.meta["optimizer_step"],
                 **exportable.describe(trained)}
        if options.format == "pt2":
            facts["mode"] = "eval"  # the program's module() refuses .eval() and .train()
            dims = exportable.dynamic(trained)
            program = export_program(trained.parts.model, inputs, dims)
            difference = largest_difference(trained.parts.model, program.module(),
                                            inputs[:CHECKED_SAMPLES])
            with writing(out):
                write_atomically(out, lambda file: save_program(program, file))
            facts["input"] = input_description(inputs, dims)
            say(f"exported {recipe.name} {trained.checkpoint} (epoch {facts['epoch']}, step "
                f"{facts['optimizer_step']}) with torch.export on {trained.device}: largest "
                f"|difference| from the model on {min(len(inputs), CHECKED_SAMPLES)} "
                f"validation samples {difference:.1e}")
        elif options.format == "onnx":
            dims = exportable.dynamic(trained)
            onnx_model = to_onnx(export_program(trained.parts.model, inputs, dims))
            difference = largest_onnx_difference(trained.parts.model, onnx_model,
                                                 inputs[:CHECKED_SAMPLES])
            with writing(out):
                write_atomically(out, lambda file: file.write(onnx_model))
            facts["input"] = input_description(inputs, dims)
            say(f"exported {recipe.name} {trained.checkpoint} (epoch {facts['epoch']}, step "
                f"{facts['optimizer_step']}) as ONNX on {trained.device}: largest |difference| "
                f"under onnxruntime from the model on {min(len(inputs), CHECKED_SAMPLES)} "
                f"validation samples {difference:.1e}")
        else:
            tensors = weights(trained.parts.model)
            facts["input"] = input_description(inputs, exportable.dynamic(trained))
            metadata = safetensors_metadata(facts)
            with writing(out):
                write_atomically(out, lambda file: file.write(
                    safetensors.torch.save(tensors, metadata=metadata)))
            say(f"exported {recipe.name} {trained.checkpoint} (epoch {facts['epoch']}, step "
                f"{facts['optimizer_step']}) as safetensors: {len(tensors)} tensors, "
                f"{sum(t.numel() for t in tensors.values()):,} values")
        with writing(json_path(out)):
            write_json_atomic(json_path(out), facts)
        say(f"wrote {out} and {json_path(out).name}")
        return 0

    return export


def safetensors_metadata(facts: dict[str, Any]) -> dict[str, str]:
    """The JSON's facts as the file's own metadata, so that the weights alone say what
    rebuilds their model: safetensors metadata maps names to strings, so each value is its
    JSON text (``json.loads(metadata["classes"])`` is the list of class names)."""
    return {key: json.dumps(value) for key, value in facts.items()}


def json_path(out: Path) -> Path:
    """``<file>.json``: next to the export, never one of a run's own JSON files."""
    return out.with_name(out.name + ".json")


def first_validation_batch(trained: Trained) -> Any:
    """The first validation batch, as the evaluator's ``prepare_batch`` gives it."""
    batch = next(iter(trained.parts.val_batches))
    return trained.parts.prepare_batch(batch, trained.device, False)


def export_program(model: torch.nn.Module, inputs: torch.Tensor,
                   dims: dict[int, Dim]) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` (in eval mode) on ``inputs``' shape, ``dims`` dynamic.
    The example has two samples: one would fix the batch dimension at 1. The program keeps
    it, so a copy: a view would take its whole batch into the file."""
    example = inputs[:2].clone() if len(inputs) > 1 else torch.cat([inputs, inputs])
    with torch.no_grad():
        return torch.export.export(model, (example,), dynamic_shapes=(dims,))


def save_program(program: torch.export.ExportedProgram, file: BinaryIO) -> None:
    """The program's archive, made in memory and then written: torch's archive writer, given
    the file, aborts the process (``std::terminate``) after a write the disk refused; a
    plain write raises the disk's ``OSError``."""
    archive = io.BytesIO()
    with warnings.catch_warnings():
        # Said of each channels_last weight (its storage is not in "complete" order); the
        # program loads them as they were, which the export's tests check on its outputs.
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(program, archive)
    file.write(archive.getbuffer())


def largest_difference(model: torch.nn.Module, exported: torch.nn.Module,
                       inputs: torch.Tensor) -> float:
    with torch.no_grad():
        return float((exported(inputs).float() - model(inputs).float()).abs().max())


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's ``state_dict`` on the CPU, contiguous and a copy of its
    own: safetensors refuses tensors that share memory (charlm's tied embedding and head)."""
    return {name: tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
            for name, tensor in model.state_dict().items()}


def input_description(inputs: torch.Tensor, dims: dict[int, Dim]) -> dict[str, Any]:
    """The model input's shape (a dynamic dimension by its name) and dtype."""
    shape = [dims[i].__name__ if i in dims else size for i, size in enumerate(inputs.shape)]
    return {"shape": shape, "dtype": str(inputs.dtype).removeprefix("torch.")}
