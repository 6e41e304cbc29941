"""Where a benchmark ran: CPU, cores, load, library versions, date, and which revision."""

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "torchvision", "pytorch-ignite", "pytorch-lightning")


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    cores: int  # logical CPUs this process may run on
    threads: int  # torch intra-op threads used by every arm
    gpu: str
    python: str
    versions: dict[str, str]
    date_utc: str
    revision: str  # the commit measured; "+ changes" when the tree differs from it


def cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo; the platform's processor string elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    """1-, 5- and 15-minute load averages: above the core count, other work shared the CPU."""
    try:
        return " / ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def git_revision() -> str:
    """The checkout's commit (short hash), with ``+ changes`` when tracked files differ from
    it: the code a figure belongs to."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + (" + changes" if git("status", "--porcelain", "--untracked-files=no")
                         else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> Machine:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return Machine(
        cpu_model=cpu_model(),
        cores=len(os.sched_getaffinity(0)),
        threads=torch.get_num_threads(),
        gpu=gpu,
        python=platform.python_version(),
        versions={name: package_version(name) for name in PACKAGES},
        date_utc=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        revision=git_revision(),
    )
