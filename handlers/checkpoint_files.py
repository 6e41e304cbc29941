"""The checkpoint files on disk: names, sidecars, verified reads and crash-safe writes.

Layout of a checkpoint folder::

    step-00001200.pt        one per save of the newest state, named by optimizer step
    step-00001200.pt.json   its sidecar: sha256 and size of the .pt, run id, position, kind
    best-step-00000900.pt   (+ .json) one per new best score
    last.pt, last.pt.json   hard links to the newest committed checkpoint of either kind
    best.pt, best.pt.json   hard links to the best one

Each file is written by ``handlers.atomic_write.write_atomically`` (temp file, fsync, rename,
fsync of the folder), so a crash at any instant leaves the previous file whole. A .pt is
trusted only when its sidecar exists and the sha256 and size match (``read_checkpoint``).
``link_atomically`` switches ``last.pt``/``best.pt`` with ``os.link`` to a temp name and
``os.replace``: hard links keep their data alive whatever retention deletes (the folder must
support hard links). The ``Checkpointer`` (``handlers.checkpoint``) decides what to write when.
"""

import hashlib
import json
import math
import os
import re
import secrets
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT_VERSION = 1
# Keys of every checkpoint besides those of the saved objects.
RESERVED_KEYS = ("meta", "checkpointer")
SIDECAR_KEYS = {"format_version", "sha256", "size_bytes", "run_id", "iteration", "optimizer_step"}
CHECKPOINT_NAME = re.compile(r"^(best-)?step-(\d+)\.pt$")
TEMP_NAME = re.compile(r"^\.((best-)?step-\d+|last|best)\.pt(\.json)?\..+\.tmp$")
_PLAIN_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype,
                torch.device)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded; ``path`` and ``reason`` say which
    and why. The recipe's command line exits 2 when a resume raises it, 4 when a save does."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def read_checkpoint(path: str | os.PathLike, *, expected_run_id: str | None = None,
                    required_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Verify ``path`` against its sidecar and load it onto the CPU with ``weights_only=True``.

    Raises ``CheckpointError`` whose ``reason`` is e.g. ``truncated (0 bytes)``,
    ``no checksum sidecar ...``, ``checksum mismatch``, ``from another run <id>`` or
    ``not a checkpoint: <error>``. Use it to read weights for evaluation:
    ``read_checkpoint("checkpoints/best.pt")["model"]``.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size == 0:
            raise CheckpointError(path, "truncated (0 bytes)")
        sidecar = read_sidecar(path)
        committed = sidecar["size_bytes"]
        if size < committed:
            raise CheckpointError(path, f"truncated ({size} of {committed} bytes)")
        if sha256_of(path) != sidecar["sha256"]:
            sizes = "" if size == committed else f" ({size} bytes, {committed} committed)"
            raise CheckpointError(path, f"checksum mismatch{sizes}")
    except OSError as err:
        raise CheckpointError(path, f"unreadable: {err}") from err
    if expected_run_id is not None and sidecar["run_id"] != expected_run_id:
        raise CheckpointError(
            path, f"from another run {sidecar['run_id']} (this run is {expected_run_id})"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refusals, zip errors: all mean "not ours"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(path, f"not a checkpoint: {first_line}") from err
    if not isinstance(payload, dict):
        raise CheckpointError(path, f"not a checkpoint: it holds a {type(payload).__name__}")
    missing = [key for key in (*RESERVED_KEYS, *required_keys) if key not in payload]
    if missing:
        raise CheckpointError(path, f"not a checkpoint of this setup: missing keys {missing}")
    return payload


def link_atomically(target: Path, link: Path) -> None:
    """Point ``link`` (and its sidecar) at ``target`` in one atomic rename each."""
    for source, destination in ((target, link), (sidecar_of(target), sidecar_of(link))):
        temp = destination.with_name(f".{destination.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.link(source, temp)
            os.replace(temp, destination)
        finally:
            temp.unlink(missing_ok=True)  # stays when destination already was this file


def sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: Path) -> dict[str, Any]:
    sidecar_path = sidecar_of(path)
    try:
        sidecar = json.loads(sidecar_path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(path, f"no checksum sidecar {sidecar_path.name}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"unreadable sidecar {sidecar_path.name}: {err}") from err
    if (
        not isinstance(sidecar, dict)
        or not sidecar.keys() >= SIDECAR_KEYS
        or not isinstance(sidecar["size_bytes"], int)
        or not isinstance(sidecar["sha256"], str)
    ):
        raise CheckpointError(path, f"unreadable sidecar {sidecar_path.name}: not a sidecar")
    if sidecar["format_version"] != FORMAT_VERSION:
        raise CheckpointError(path, f"format version {sidecar['format_version']}, this code "
                                    f"reads {FORMAT_VERSION}")
    return sidecar


def claimed_position(path: Path) -> tuple[float, float]:
    """(optimizer step, iteration) to order resume candidates, newest first: the step from
    the file name, else from the sidecar; without a readable sidecar ``last.pt`` still comes
    first and ``best.pt`` last. Only an order: every candidate is verified before use."""
    try:
        sidecar = json.loads(sidecar_of(path).read_bytes())
        claimed = (int(sidecar["optimizer_step"]), int(sidecar["iteration"]))
    except (OSError, ValueError, KeyError, TypeError):
        claimed = (math.inf, math.inf) if path.name == "last.pt" else (-1, -1)
    named = CHECKPOINT_NAME.match(path.name)
    return (int(named[2]), claimed[1]) if named else claimed


def unloadable_entry(value: Any, where: str = "checkpoint") -> str | None:
    """Describe the first entry that ``torch.load(weights_only=True)`` would refuse, or None."""
    if type(value) in (torch.Tensor, nn.Parameter) or type(value) in _PLAIN_TYPES:
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            found = unloadable_entry(key, f"{where} key {key!r}")
            found = found or unloadable_entry(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            found = unloadable_entry(item, f"{where}[{index}]")
            if found:
                return found
        return None
    return f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) refuses"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
