"""Where a benchmark ran: CPU, cores, load, library versions, date."""

import datetime
import os
import platform
from dataclasses import dataclass
from importlib import metadata

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
    )
