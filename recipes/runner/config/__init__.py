"""A run's config: the typed keys of the command line and of ``--config`` files, the run keys
every recipe shares, the recipes found by name, and the user errors (exit 2). Imports no
torch, so that ``python -m recipes`` checks the command line before torch loads."""
