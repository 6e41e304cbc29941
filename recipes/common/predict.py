"""``python -m recipes <cifar|images> predict <run or checkpoint> FILE_OR_FOLDER...``: the
classes and probabilities of image files, with a trained classifier.

The recipe gives two things (``predict_command(image_batch, class_names)``): how decoded
images become one batch as its evaluation batches come (``image_batch``, the recipe's own
resize and normalisation), and its class names. The batch then goes through the run's
``prepare_batch`` and ``predict`` hooks (test-time augmentation included), at the run's
precision, as an evaluation does; probabilities are the softmax of those logits.
"""

import csv
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events

from engine.trainer import create_evaluator
from handlers.atomic_write import write_atomically
from recipes.common.image_files import IMAGE_SUFFIXES, has_image_suffix, read_image
from recipes.runner.api import Recipe
from recipes.runner.commands.command_parser import CommandParser, output_path, positive_int, writing
from recipes.runner.commands.trained import Trained, load_trained
from recipes.runner.config.command_line import DataError

ImageBatch = Callable[[Trained, list[torch.Tensor]], Any]  # uint8 [3,H,W] images -> a batch
CHUNK = 64  # images per forward
DEFAULT_TOP_K = 3


def predict_command(image_batch: ImageBatch, class_names: Callable[[Any], Sequence[str]]
                    ) -> Callable[[Recipe, list[str]], int]:
    """The ``predict`` command of a classifier recipe; ``class_names(data)`` from its data."""

    def predict(recipe: Recipe, args: list[str]) -> int:
        parser = CommandParser(recipe, "predict", "The classes and probabilities of image "
                               "files, decoded and normalised as in training.")
        parser.add_argument("inputs", nargs="+", metavar="FILE_OR_FOLDER",
                            help="image files, or folders searched for them (recursively)")
        parser.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K,
                            help=f"classes shown per image (default {DEFAULT_TOP_K})")
        parser.add_argument("--out", default=None,
                            help="also write the predictions to this .csv or .json file")
        options = parser.parse_args(args)
        out = None if options.out is None else output_path(options.out, (".csv", ".json"))
        # The images before the model: a wrong path fails fast, before the data is loaded.
        files, images = read_images(list_images(options.inputs))
        if not images:
            raise DataError(f"no image could be read among {' '.join(options.inputs)}")
        trained = load_trained(recipe, options.source, options.checkpoint, options.device)
        classes = list(class_names(trained.data))
        rows = classify(trained, image_batch, files, images, min(options.top_k, len(classes)),
                        classes)
        for path, top in rows:
            print(f"{path}  " + "  ".join(f"{name} {p:.3f}" for name, p in top))
        if out is not None:
            with writing(out):
                write_predictions(out, rows, trained)
            print(f"wrote {out}")
        return 0

    return predict


def list_images(inputs: Sequence[str]) -> list[str]:
    """The files to read: each file given, and the image files (by suffix) in each folder
    given, sorted; what is skipped is named on stderr, one line each. ``DataError`` when
    nothing is left."""
    files: list[str] = []
    for given in inputs:
        if os.path.isfile(given):
            files.append(given)
        elif os.path.isdir(given):
            for folder, subfolders, names in os.walk(given):
                subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
                for name in sorted(name for name in names if not name.startswith(".")):
                    path = os.path.join(folder, name)
                    if has_image_suffix(name):
                        files.append(path)
                    else:
                        print(f"skipped {path}: not an image file", file=sys.stderr)
        else:
            print(f"skipped {given}: no such file or folder", file=sys.stderr)
    if not files:
        raise DataError(f"no image files among {' '.join(inputs)}: give image files "
                        f"({' '.join(IMAGE_SUFFIXES)}) or folders holding them")
    return files


def read_images(files: list[str]) -> tuple[list[str], list[torch.Tensor]]:
    """(files, uint8 [3,H,W] images) of the files that decode as in training; one that
    does not is named on stderr and skipped."""
    readable, images = [], []
    for path in files:
        try:
            images.append(read_image(path))
            readable.append(path)
        except DataError as error:
            print(f"skipped: {error}", file=sys.stderr)
    return readable, images


def classify(trained: Trained, image_batch: ImageBatch, files: list[str],
             images: list[torch.Tensor], top_k: int, classes: list[str]
             ) -> list[tuple[str, list[tuple[str, float]]]]:
    """(file, [(class, probability)] most likely first) for each of ``images``."""
    parts = trained.parts
    evaluator = create_evaluator(parts.model, {}, device=trained.device,
                                 precision=trained.config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    probabilities: list[torch.Tensor] = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: probabilities.append(
        engine.state.output[0].float().softmax(-1).cpu()))
    evaluator.run([image_batch(trained, images[start:start + CHUNK])
                   for start in range(0, len(images), CHUNK)])
    values, indices = torch.cat(probabilities).topk(top_k, dim=-1)
    return [(path, [(classes[i], p) for i, p in zip(index.tolist(), value.tolist(), strict=True)])
            for path, value, index in zip(files, values, indices, strict=True)]


def write_predictions(out: Path, rows: list[tuple[str, list[tuple[str, float]]]],
                      trained: Trained) -> None:
    """``.csv``: one row per (file, rank); ``.json``: the checkpoint and each file's list.
    Written through a temp file: a failed write leaves an earlier file of that name whole."""
    if out.suffix.lower() == ".csv":
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(["path", "rank", "class", "probability"])
        for path, top in rows:
            writer.writerows([path, rank, name, f"{p:.6f}"]
                             for rank, (name, p) in enumerate(top, 1))
        content = text.getvalue()
    else:
        content = json.dumps({
            "checkpoint": str(trained.checkpoint),
            "predictions": [{"path": path, "top": [{"class": name, "probability": p}
                                                    for name, p in top]} for path, top in rows],
        }, indent=2) + "\n"
    write_atomically(out, lambda file: file.write(content.encode()), file_mode=0o644)
