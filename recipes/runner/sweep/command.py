"""``python -m recipes <recipe> sweep --trials N --search KEY=SPEC ... [--key value ...]``:
search the recipe's keys with Optuna (docs/sweeps.md).

In order: the options and every trial's fixed keys are checked, then the data and the study's
storage (nothing is written before those pass); the sweep folder and its study are made or
found again; this worker trains trials until the study holds N finished or pruned ones
(``trials.py``); the table of trials closes it (``status.py``). Ctrl-C stops the trial in
training as it stops a run (saved) and prints the command that continues the sweep.
"""

import shlex

from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError, ExitCode
from recipes.runner.console import recipes_command, say
from recipes.runner.resume.same_run import continue_command
from recipes.runner.sweep.options import SweepOptions, parse_options
from recipes.runner.sweep.status import status_lines
from recipes.runner.sweep.study import PRUNERS, SAMPLERS, StudyPlace, load_study, open_study
from recipes.runner.sweep.trials import Sweep, work
from recipes.runner.training.launch import launched_by_torchrun
from recipes.runner.training.start_checks import check_recipe_keys


def sweep(recipe: Recipe, args: list[str]) -> int:
    """Run (or continue, or with ``--status`` show) a sweep of ``recipe``'s keys."""
    options = parse_options(recipe, args)
    place = StudyPlace.of(options.sweep_dir, options.name, options.storage)
    if options.status:
        study = load_study(place)
        say(*status_lines(study, recipe.name, options.metric, options.sweep_dir))
        return 0
    _check_before_writing(recipe, options, place)
    options.sweep_dir.mkdir(parents=True, exist_ok=True)
    direction = "maximize" if recipe.metrics[options.metric] == "max" else "minimize"
    study = open_study(place, options.definition, direction, SAMPLERS[options.sampler](),
                       PRUNERS[options.pruner]())
    say(*_header(recipe, options, place, direction), flush=True)
    sweep_ = Sweep(recipe, options.config, options.given, options.searches, options.metric,
                   options.trials, options.sweep_dir, study)
    try:
        exit_code = work(sweep_)
    except KeyboardInterrupt:  # between trials: the trial in training stops itself, saved
        exit_code = ExitCode.INTERRUPTED
    say("", *status_lines(study, recipe.name, options.metric, options.sweep_dir,
                          options.trials))
    if exit_code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
        say(f"stopped; to continue this sweep: {continue_command()}")
    return exit_code


def _check_before_writing(recipe: Recipe, options: SweepOptions, place: StudyPlace) -> None:
    """What would refuse every trial, and a storage that is not a study's, before the sweep
    folder or its database is written."""
    if launched_by_torchrun():
        raise ConfigError("sweep: under torchrun every process would take trials of its own; "
                          "start it with python -m recipes (more workers: the same command "
                          "again)")
    check_recipe_keys(recipe, options.config)
    place.check()
    data = recipe.load_data(options.config)  # a DataError here leaves nothing on disk
    if options.config.batch_size > recipe.sample_counts(data)[0]:
        raise ConfigError(f"--batch-size {options.config.batch_size} exceeds the "
                          f"{recipe.sample_counts(data)[0]} training samples")


def _header(recipe: Recipe, options: SweepOptions, place: StudyPlace, direction: str
            ) -> list[str]:
    searched = "; ".join(search.described() for search in options.searches)
    return [f"{recipe.name} sweep {options.name} in {options.sweep_dir}",
            f"  search   {searched}",
            f"  goal     {direction} validation {options.metric}; {options.trials} trials, "
            f"sampler {options.sampler}, pruner {options.pruner}",
            f"  study    {place.name} in {place.url} (optuna.load_study reads it)",
            f"  status   {_status_command(recipe, options)}"]


def _status_command(recipe: Recipe, options: SweepOptions) -> str:
    """The command that prints this sweep's table from another terminal."""
    words = [recipes_command(recipe.name), "sweep", "--status", "--sweep-dir",
             shlex.quote(str(options.sweep_dir))]
    if options.name != options.sweep_dir.name:
        words += ["--sweep-name", options.name]
    if options.storage:
        words += ["--storage", shlex.quote(options.storage)]
    return " ".join(words)
