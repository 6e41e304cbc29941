"""The run layer: the same for every recipe, and not edited to add one.

A recipe imports what it states its task with from here; ``run`` (in ``run.py``) owns the
run folder, resume, the standard handlers, the launch and the summary.

The names below load on first use: importing a torch-free module of this package (the
config, the run keys) must not import torch, so that ``python -m recipes`` checks the
command line before torch loads.
"""

import importlib
from typing import Any

_MODULE_OF = {
    "Context": "api", "Parts": "api", "Recipe": "api", "RunPlan": "api",
    "ConfigError": "config", "field": "config",
    "DataError": "errors",
    "fingerprint_arrays": "fingerprint", "fingerprint_files": "fingerprint",
    "RunConfig": "run_config",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
