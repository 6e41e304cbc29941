"""``--search KEY=SPEC``: one of the recipe's keys and the values a sweep tries for it.

SPEC is ``LOW:HIGH`` (uniform), ``LOW:HIGH:log`` (log-uniform) or ``A,B,C`` (choices). An
integer key draws integers, a number key numbers; a switch or text key takes choices only.
Every value is typed and checked as the command line types and checks that key
(``config.command_line``): a range's two ends, and each choice, must be values
``--KEY`` itself would take. Torch-free, as the command line's checks are: a mistake is one
line before anything loads or is written.
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from recipes.runner.config.command_line import (
    ConfigError,
    base_type,
    check_value,
    flag_name,
    shown_value,
    typed_value,
    unknown_key,
)

# Keys that place a trial or ask something of one start, not what a trial trains: the sweep
# sets them itself (the trial's folder, its resume) or they hold for every trial.
NOT_SEARCHED = ("run_dir", "run_name", "resume", "nproc", "progress", "allow_data_change",
                "init_from", "overfit_batches", "tracker", "tracker_uri")
GRAMMAR = "LOW:HIGH, LOW:HIGH:log or A,B,C"


@dataclass(frozen=True)
class Search:
    """The values key ``name`` takes in a sweep: ``choices``, or ``low`` to ``high`` (integers
    when ``integer``, on a log scale when ``log``). ``text`` is the SPEC as given."""

    name: str
    text: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """This key's value for the Optuna ``trial`` (stored in it under the key's name: a
        trial resumed elsewhere gets the same value back)."""
        if self.choices:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def described(self) -> str:
        """``lr 0.0001..0.1 (log)``, ``model resnet18|resnet34``: for the sweep's first lines."""
        if self.choices:
            return f"{flag_name(self.name)} {'|'.join(shown_value(c) for c in self.choices)}"
        scale = " (log)" if self.log else ""
        return f"{flag_name(self.name)} {shown_value(self.low)}..{shown_value(self.high)}{scale}"


def parse_searches(config_cls: type, texts: list[str]) -> list[Search]:
    """Every ``--search`` of the command line, checked; a key searched twice is refused."""
    searches = [parse_search(config_cls, text) for text in texts]
    names = [search.name for search in searches]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--search: {flag_name(name)} is searched twice; give it once")
    return searches


def parse_search(config_cls: type, text: str) -> Search:
    """One ``KEY=SPEC`` (the key as in a flag, ``weight-decay``, or as in a config file,
    ``weight_decay``); ConfigError naming the key and what it takes."""
    key, has_spec, spec = text.partition("=")
    if not has_spec or not key or not spec:
        raise ConfigError(f"--search {text}: give KEY=SPEC, SPEC being {GRAMMAR} "
                          "(e.g. --search lr=1e-4:1e-1:log)")
    fields = {spec_.name: spec_ for spec_ in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    name = key.removeprefix("--").replace("-", "_")
    if name not in fields:
        raise ConfigError(f"--search {text}: {unknown_key(name, list(fields), hints)}")
    if name in NOT_SEARCHED:
        raise ConfigError(f"--search {text}: {flag_name(name)} is not searched (it places a "
                          "trial or holds for all of them); give it as a flag instead")
    kind = base_type(hints[name])[0]
    field = fields[name]
    if "," in spec:
        return _choices(name, text, spec, field, hints[name])
    if ":" in spec:
        if kind not in (int, float):
            raise ConfigError(f"--search {text}: {flag_name(name)} takes "
                              f"{'true or false' if kind is bool else 'text'}, not a range; "
                              "give choices A,B,C")
        return _range(name, text, spec, field, hints[name], kind is int)
    raise ConfigError(f"--search {text}: SPEC must be {GRAMMAR}, got {spec!r}")


def _choices(name: str, text: str, spec: str, field: dataclasses.Field, hint: Any) -> Search:
    values = tuple(_value(text, name, item.strip(), field, hint) for item in spec.split(","))
    if len(set(values)) < 2:
        raise ConfigError(f"--search {text}: choices need two different values at least")
    return Search(name, spec, choices=values)


def _range(name: str, text: str, spec: str, field: dataclasses.Field, hint: Any,
           integer: bool) -> Search:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
        raise ConfigError(f"--search {text}: SPEC must be {GRAMMAR}, got {spec!r}")
    low, high = (_value(text, name, part.strip(), field, hint) for part in parts[:2])
    if low is None or high is None:
        raise ConfigError(f"--search {text}: a range needs numbers at both ends; none is a "
                          "choice (A,B,C)")
    if not low < high:
        raise ConfigError(f"--search {text}: LOW must be below HIGH, got {low} and {high}")
    log = len(parts) == 3
    if log and low <= 0:
        raise ConfigError(f"--search {text}: a log range needs LOW > 0, got {low}")
    return Search(name, spec, low=low, high=high, log=log, integer=integer)


def _value(text: str, name: str, item: str, field: dataclasses.Field, hint: Any) -> Any:
    """``item`` typed and checked as ``--name item`` would be (its type, range and choices)."""
    try:
        value = typed_value(name, item, hint)
        check_value(field, value)
    except ConfigError as error:
        raise ConfigError(f"--search {text}: {error}") from None
    return value


def shown_param(value: Any) -> str:
    """A trial's value as the table and the console show it: a number to 4 digits."""
    return f"{value:.4g}" if isinstance(value, float) else shown_value(value)
