"""The run layer: the same for every recipe, and not edited to add one.

A recipe (and ``python -m recipes``) imports each name from the module that defines it; these
modules are the layer's public surface (tests/recipes/runner/test_public_surface.py keeps
recipes to them), the rest of its folders are private and free to change:

- ``api``: what a recipe declares (``Recipe``, ``Parts``, ``Context``, ``RunPlan``);
- ``config.run_keys`` (``RunConfig``), ``config.command_line`` (``field``, ``ConfigError``,
  ``DataError``, ``ExitCode``), ``config.file``, ``config.registry``:
  the typed keys and the user errors, torch-free, so that ``python -m recipes`` checks the
  command line before torch loads;
- ``training.run`` (``run``), ``training.modes``, ``training.fingerprint``,
  ``training.init_from``, ``training.strategy``, ``training.launch`` (``USER_ERRORS``, the
  errors that are the user's to mend: exit 2): the run;
- ``commands.command_parser``, ``commands.dispatch``, ``commands.export``,
  ``commands.trained``: the commands next to training;
- ``console``: the voice every line is said in, and the Python a printed command names.
"""
