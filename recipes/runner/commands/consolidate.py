"""``python -m recipes <recipe> consolidate <run or checkpoint> [--checkpoint best|last]
[--out FILE.pt]``: a checkpoint as one file in the single-file format.

For a run trained with ``--strategy fsdp``, whose checkpoints are sharded ``.dcp`` folders:
the folder is verified (every shard's checksum) and its shards gathered into whole tensors
on the CPU (``handlers.checkpoint.sharded.read_sharded``), then written as the .pt file a
one-process run would have saved, with its checksum sidecar:
``torch.load(file, weights_only=True)["model"]`` is a plain ``state_dict`` for the recipe's
model, the optimizer's state is keyed by index as ``optimizer.state_dict()`` keys it, and
``--init-from FILE`` starts a ``--strategy ddp`` run from its weights. ``evaluate``,
``export`` and ``predict`` read the folders directly; this command is for plain PyTorch and
other tools. The file goes to ``<run>/export/<checkpoint>.pt`` (or ``--out``), with
``<file>.json``, its sidecar; nothing else is written.
"""

from pathlib import Path

from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.files import SingleFile
from handlers.checkpoint.formats import read_checkpoint
from recipes.runner.api import Recipe
from recipes.runner.commands.command_parser import CommandParser, output_path, writing
from recipes.runner.commands.trained import find_checkpoint, saved_config
from recipes.runner.console import say


def consolidate(recipe: Recipe, args: list[str]) -> int:
    """The checkpoint as one .pt file (its sharded folder gathered), with its sidecar."""
    parser = CommandParser(recipe, "consolidate", consolidate.__doc__)
    parser.add_argument("--out", default=None,
                        help="the .pt file to write (default: <run>/export/<checkpoint>.pt); "
                        "its sidecar goes next to it as <file>.json")
    options = parser.parse_args(args)
    out = None if options.out is None else output_path(options.out, (".pt",))
    path, run_dir = find_checkpoint(options.source, options.checkpoint)
    payload = read_checkpoint(path, required_keys=("model",))
    saved_config(recipe, path, payload["meta"])  # refuses another recipe's checkpoint
    if out is None:
        out = run_dir / "export" / f"{Path(path).stem}.pt"
    meta = {key: value for key, value in payload["meta"].items() if key != "config"}
    with writing(out):
        out.parent.mkdir(exist_ok=True)
        SingleFile().write(out, payload, meta, file_mode=0o640, crash=CrashPoints())
    tensors = sum(1 for value in payload["model"].values() if hasattr(value, "shape"))
    say(f"consolidated {recipe.name} {path} (epoch {meta['epoch']}, step "
        f"{meta['optimizer_step']}): {tensors} model tensors")
    say(f"wrote {out} and {out.name}.json")
    return 0
