"""Typed recipe configs from the command line.

A recipe's config is a dataclass; every field is a flag (`--batch-size 512` or
`--batch-size=512`). Field metadata carries the help text, the checks and the key's group,
so ``--help`` (in blocks by group), validation and error messages come from one place.
Errors are a ``ConfigError`` with one line naming the key and what is allowed; the command
line turns it into exit code 2 before anything touches the disk. A ``DataError`` is the
data's (missing, unreadable, malformed): the user's to mend too, exit 2.
"""

import dataclasses
import difflib
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message is one line for the user."""


class DataError(RuntimeError):
    """The data is missing, unreadable or malformed; the message names the file or folder
    and what is expected."""


class ExitCode(IntEnum):
    """The exit status of ``python -m recipes``, a training run or a command after it; the
    table in docs/reference.md (#exit-codes) says the same. 130, 138 and 143 are
    ``handlers.graceful_stop.EXIT_CODES``' (128 + the signal), as shells report them."""

    DONE = 0  # trained, stopped by --max-steps/--max-time, already complete, a command's result
    FAILED = 1  # an error nobody foresaw: Python's traceback (please report it)
    USER_ERROR = 2  # something to change (a key, a file, the data): one line, nothing written
    NON_FINITE = 3  # non-finite gradients or loss spikes that a rollback did not cure
    DISK = 4  # the disk refused a write (the run folder, a checkpoint, a command's output)
    PEER_LOST = 5  # a process of the group died or stopped answering: one line names it
    INTERRUPTED = 130  # Ctrl-C (SIGINT): the step finished and saved
    PREEMPTED = 138  # SIGUSR1 (a scheduler's notice before it preempts): finished and saved
    BROKEN_PIPE = 141  # the reader of the output went away (e.g. `| head`)
    TERMINATED = 143  # SIGTERM: the step finished and saved


def field(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    check: Callable[[Any], str | None] | None = None,
    fixed_on_resume: bool = False,
    group: str | None = None,
) -> Any:
    """A config field. ``check(value)`` returns an error text or None.

    A value outside ``choices`` is refused naming them, with ``check``'s text for it as the
    reason when it gives one. ``fixed_on_resume`` marks keys that shape the saved state
    (model, batch shapes): a resumed run refuses to change them. ``group`` names the block of
    ``--help`` that lists the key (and ``group_values`` reads); a field declared again
    without one keeps the group of the field it replaces.
    """
    metadata = {
        "help": help,
        "group": group,
        "choices": tuple(choices) if choices is not None else None,
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "check": check,
        "fixed_on_resume": fixed_on_resume,
    }
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def group_of(config_cls: type, name: str) -> str | None:
    """The group of key ``name``: its own field's, else that of the nearest base class that
    declares it with one (a recipe that changes a run key's default keeps it in its group)."""
    for cls in config_cls.__mro__:
        spec = vars(cls).get("__dataclass_fields__", {}).get(name)
        if spec is not None and spec.metadata.get("group"):
            return spec.metadata["group"]
    return None


def group_values(config: Any, group: str) -> dict[str, Any]:
    """The values of ``group``'s keys by name, without the prefix ``<group>_``: the keyword
    arguments of whatever the group configures (``group_values(config, "spike")`` gives
    ``{"factor": 6.0, "window": 100, ...}``)."""
    return {spec.name.removeprefix(f"{group}_"): getattr(config, spec.name)
            for spec in dataclasses.fields(config) if group_of(type(config), spec.name) == group}


def base_type(annotation: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) for ``int``, ``float | None`` and so on."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def typed_value(name: str, text: str, annotation: Any) -> Any:
    """``text`` as the value of key ``name`` of type ``annotation`` (``none`` for an optional
    key); ConfigError naming the flag and the type it takes."""
    kind, optional = base_type(annotation)
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        allowed = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        none = " or none" if optional else ""
        raise ConfigError(f"{flag_name(name)}: expected {allowed}{none}, got {text!r}") from None
    return text


def validate(config: Any) -> None:
    """Check every field against its metadata; raise ConfigError on the first bad one."""
    for spec in dataclasses.fields(config):
        check_value(spec, getattr(config, spec.name))


def check_value(spec: dataclasses.Field, value: Any) -> None:
    """Check one field's value against its metadata (ConfigError naming the key)."""
    meta, key = spec.metadata, flag_name(spec.name)
    if value is None:
        return
    if isinstance(value, str) and (problem := text_problem(value)):
        raise ConfigError(f"{key}: {problem}")
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(str(c) for c in meta["choices"])
        why = meta["check"](value) if meta.get("check") else None  # a field's own reason
        raise ConfigError(f"{key}: {value!r} is not allowed{f' ({why})' if why else ''}; "
                          f"choose one of: {allowed}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        low, high = meta.get("min"), meta.get("max")
        if low is not None and (value <= low if meta.get("min_exclusive") else value < low):
            relation = ">" if meta.get("min_exclusive") else ">="
            raise ConfigError(f"{key}: must be {relation} {low}, got {value}")
        if high is not None and value > high:
            raise ConfigError(f"{key}: must be <= {high}, got {value}")
    if meta.get("check") and (problem := meta["check"](value)):
        raise ConfigError(f"{key}: {problem}")


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot reach the OS or a file as it is, else None: a NUL byte (no path or
    name may hold one: a config file can spell it ``\\u0000``), or bytes that are not UTF-8
    (Python keeps a command line's as lone surrogates, which cannot be printed or written)."""
    if "\0" in text:
        return f"must not hold a NUL byte, got {text!r}"
    try:
        text.encode()
    except UnicodeEncodeError:
        try:  # the bytes as given
            shown = text.encode(errors="surrogateescape")
        except UnicodeEncodeError:  # a surrogate that a JSON file spelled out (\\ud800)
            return f"must be UTF-8 text, got {text!r}"
        return f"must be UTF-8 text, got the bytes {shown!r}"
    return None


def parse_args(config_cls: type, argv: Sequence[str],
               base: dict[str, Any] | None = None) -> tuple[Any, set[str]]:
    """Parse ``--key value`` / ``--key=value`` into ``config_cls``, over ``base`` (a config
    file's values by key); also return the keys given (``base``'s included)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    args = list(argv)
    while args:
        token = args.pop(0)
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}; flags look like --key value")
        key, has_value, text = token[2:].partition("=")
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(unknown_key(name, fields, hints))
        if not has_value:
            if not args or args[0].startswith("--"):
                if base_type(hints[name])[0] is not bool:
                    raise ConfigError(f"{flag_name(name)}: missing value")
                text = "true"  # a bare switch, as most command lines take it: --compile
            else:
                text = args.pop(0)
        if name in values:
            raise ConfigError(f"{flag_name(name)}: given twice")
        values[name] = typed_value(name, text, hints[name])
    config = config_cls(**{**(base or {}), **values})
    validate(config)
    return config, set(values) | set(base or {})


def unknown_key(name: str, fields: Sequence[str], hints: dict[str, Any]) -> str:
    """``unknown key --x; did you mean ...?``; for ``--no-<switch>`` the spelling that turns
    the switch off (``--lookahead false``)."""
    switch = name.removeprefix("no_")
    if switch != name and switch in fields and base_type(hints[switch])[0] is bool:
        hint = f"; to turn {flag_name(switch)} off, say {flag_name(switch)} false"
    else:
        close = difflib.get_close_matches(name, fields, n=1)  # the closest: one guess
        hint = f"; did you mean {flag_name(close[0])}?" if close else ""
    return f"unknown key {flag_name(name)}{hint} (see --help for all keys)"


def shown_value(value: Any) -> str:
    """A value as the command line and config files spell it: ``none``, ``true``, ``false``
    (not Python's None, True, False)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def help_text(config_cls: type, prog: str, description: str, recipe_name: str,
              width: int = 100) -> str:
    """Usage, an example, ``description``, then the keys (default, meaning) in blocks headed
    by their group, in the order the groups are first declared; the keys without a group
    last, under ``recipe_name``. Meanings wrap at ``width`` columns, each continuation under
    the meaning's first character, so that the three columns stay aligned in a terminal."""
    specs = dataclasses.fields(config_cls)
    flag_width = max(len(flag_name(spec.name)) for spec in specs)
    default_width = max(len(shown_value(spec.default)) for spec in specs)
    indent = " " * (2 + flag_width + 2 + default_width + 2)
    blocks: dict[str | None, list[str]] = {}
    for spec in specs:
        meta = spec.metadata
        allowed = f" [{' | '.join(str(c) for c in meta['choices'])}]" if meta.get("choices") else ""
        default = shown_value(spec.default)
        columns = f"  {flag_name(spec.name):<{flag_width}}  {default:<{default_width}}  "
        blocks.setdefault(group_of(config_cls, spec.name), []).extend(textwrap.wrap(
            meta["help"] + allowed, max(width, len(indent) + 30), initial_indent=columns,
            subsequent_indent=indent, break_on_hyphens=False))
    own = blocks.pop(None, [])
    lines = [f"usage: {prog} [--key value ...]",
             f"example: {prog} --epochs 2 --run-name first-try",
             f"from a file: {prog} --config FILE.toml (or .json); --print-config prints one",
             "also: --describe prints the run's wiring (every event and its handlers); "
             "--lr-find runs an LR range test and suggests --lr",
             "",
             description, "",
             "keys (default, meaning); every key takes a value, true/false for a switch "
             "(a bare switch is true):"]
    for heading, keys in [*blocks.items(), (f"{recipe_name} (the recipe's own keys)", own)]:
        if keys:
            lines += ["", f"{heading}:", *keys]
    return "\n".join(lines)


# The keys that place a run's folder: they say where it is, not what it trains.
FOLDER_KEYS = ("run_dir", "run_name")


def resume_overrides(saved: dict[str, Any], config: Any, given: set[str]
                     ) -> tuple[Any, list[str]]:
    """A resumed run's config, settled from its saved one, and the ``override:`` lines.

    The precedence (docs/reference.md#precedence): keys marked ``fixed_on_resume`` must not
    change (ConfigError naming the key); other keys given on the command line win and are
    reported as ``override: key old -> new``; keys not given are taken from the saved run.
    ``config`` itself is left as it is: the settled one is a new value.
    """
    messages, taken_back = [], {}
    for spec in dataclasses.fields(config):
        if spec.name not in saved:
            continue
        old, new = saved[spec.name], getattr(config, spec.name)
        if spec.name not in given:
            taken_back[spec.name] = old
        elif old != new and spec.name not in FOLDER_KEYS:  # where, not what
            if spec.metadata.get("fixed_on_resume"):
                raise ConfigError(
                    f"{flag_name(spec.name)}: cannot change on resume ({old!r} -> {new!r}); it "
                    "shapes the saved state. Start a new run (another --run-name) instead"
                )
            messages.append(f"override: {spec.name} {old!r} -> {new!r}")
    settled = dataclasses.replace(config, **taken_back)
    validate(settled)
    return settled, messages
