"""The reproducibility record of a run: what software and hardware it ran on.

Written into ``config.json`` (at each start, so a resumed run describes its latest start)
and ``summary.json``. It describes a run and is never compared: a run resumed on another
machine or with another torch is fine.
"""

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[3]
GIT_TIMEOUT_SEC = 5  # a hung git (a network file system) must not hold up the run
PACKAGES = ("torch", "torchvision", "pytorch-ignite")


def environment_record(device: torch.device, processes: int) -> dict[str, Any]:
    """Python and package versions, the project's git revision and the device."""
    return {"python": platform.python_version(),
            "packages": {name: _version(name) for name in PACKAGES},
            "git": git_revision(REPO),
            "device": {"type": device.type, "name": device_name(device),
                       "count": _device_count(device), "processes": processes}}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_revision(folder: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` when ``folder`` is a git checkout (dirty: ``git status
    --porcelain`` lists a change), else None: no git, not a checkout, or git too slow."""
    commit = _git(folder, "rev-parse", "HEAD")
    if commit is None:
        return None
    status = _git(folder, "status", "--porcelain")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_SEC, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def _device_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1
