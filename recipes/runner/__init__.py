"""The run layer: the same for every recipe, and not edited to add one.

A recipe imports what it states its task with from here; ``run`` (in ``run.py``) owns the
run folder, resume, the standard handlers, the launch and the summary.
"""

from recipes.runner.api import Context, Parts, Recipe, RunPlan
from recipes.runner.config import ConfigError, field
from recipes.runner.errors import DataError
from recipes.runner.fingerprint import fingerprint_arrays, fingerprint_files
from recipes.runner.run_config import RunConfig

__all__ = ["ConfigError", "Context", "DataError", "Parts", "Recipe", "RunConfig", "RunPlan",
           "field", "fingerprint_arrays", "fingerprint_files"]
