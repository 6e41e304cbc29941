"""``--config FILE`` and ``--print-config``: a recipe's keys read from a TOML or JSON file,
and the resolved config written back as TOML.

A config file holds the command line's keys at its top level, spelled ``batch_size`` or
``batch-size`` (config.json's spelling and the flag's), with typed values: ``true``/``false``
for a switch, a number for a number, a string for a text key, and the string ``"none"`` for
no value (TOML has no null; JSON's ``null`` works too). Precedence (docs/reference.md
#precedence): defaults < the file < the command line. Every key in the file counts as given,
as if typed: on a resume it overrides the saved run's value (or is refused, for a key fixed
on resume).

A run folder's ``config.json`` is a config file too: its ``config`` table holds the keys,
and what only describes that run (its id, folder, data fingerprint, environment record)
is ignored with one note, so that the same keys start a new run (another ``--seed``,
``--run-name``, ...). Without a folder named, that start never continues the run the file
came from (``parse_start``): it trains a run of its own, which the same command continues.

YAML is not read: flat scalar keys need nothing TOML lacks, and YAML's implicit typing
turns ``1e-3`` into a string (PyYAML) and ``no`` into false, the mistakes this file's
strict types are there to catch. TOML is written by the few lines below rather than a
dependency: the values are flat scalars.
"""

import dataclasses
import json
import os
import re
import stat
import textwrap
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipes.runner.config.command_line import (
    FOLDER_KEYS,
    ConfigError,
    base_type,
    check_value,
    flag_name,
    group_of,
    parse_args,
    unknown_key,
)
from recipes.runner.console import recipes_command, warn

# What a run folder's config.json holds besides its keys: they describe that run.
RUN_RECORD = ("recipe", "run_id", "data", "environment", "init_from")
# Keys that ask something of one start only, not of the run (resume.request.REQUEST_KEYS,
# which imports torch): config.json never holds them, nor does a config file.
REQUESTS = ("resume",)
# Keys of a run's config.json that name its folder or ask something of one start only.
RUN_PLACE = (*FOLDER_KEYS, *REQUESTS)
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_TOML_LINE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_WIDTH = 100
MAX_BYTES = 1024 * 1024  # --print-config's whole output is about 10 KiB


def parse_command_line(config_cls: type, argv: Sequence[str]) -> tuple[Any, set[str]]:
    """``parse_args`` with ``--config FILE``: the file's keys under the command line's.
    Returns the config and the keys given in either."""
    config, given, _ = parse_start(config_cls, argv)
    return config, given


def parse_start(config_cls: type, argv: Sequence[str]) -> tuple[Any, set[str], str]:
    """``parse_command_line``, and the run id of the run folder's ``config.json`` that
    ``--config`` names (else ""): a start without a folder of its own must not continue that
    run (it is the source of the keys, not the run)."""
    args, path = _take_config_option(list(argv))
    base, source = read_config_file(path, config_cls) if path is not None else ({}, "")
    return (*parse_args(config_cls, args, base), source)


def _take_config_option(args: list[str]) -> tuple[list[str], str | None]:
    """The arguments without ``--config FILE`` (or ``--config=FILE``), and FILE."""
    rest, path = [], None
    while args:
        token = args.pop(0)
        name, has_value, value = token.partition("=")
        if name != "--config":
            rest.append(token)
            continue
        if not has_value:
            if not args or args[0].startswith("--"):
                raise ConfigError("--config: missing value (a .toml or .json file)")
            value = args.pop(0)
        if path is not None:
            raise ConfigError("--config: given twice")
        path = value
    return rest, path


def read_config_file(path: str, config_cls: type) -> tuple[dict[str, Any], str]:
    """The keys of the TOML or JSON file ``path`` as ``config_cls``'s field values, each
    checked as on the command line, and the run id when it is a run folder's config.json
    (else ""); ConfigError (one line naming the file, and the line where there is one) for
    anything the command line would refuse."""
    text = _read_text(path)
    table = _parse(path, text)
    keys, ignored = _keys_of(table, config_cls)
    if ignored and os.environ.get("RANK", "0") == "0":  # once under torchrun
        warn(f"note: {path} is run {table['run_id']}'s config.json: taking its keys, not its "
             f"run (ignoring {', '.join(ignored)}); to continue that run itself: --run-dir "
             f"{Path(path).parent}")
    fields = {spec.name: spec for spec in dataclasses.fields(config_cls)}
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for key, value in keys.items():
        name = key.replace("-", "_")
        try:
            if name not in fields and isinstance(value, dict):
                raise ConfigError(f"{key}: a table; a config file holds its keys at the top "
                                  "level (--print-config's groups are comments)")
            if name not in fields:
                raise ConfigError(unknown_key(name, list(fields), hints))
            if name in REQUESTS:
                raise ConfigError(f"{flag_name(name)}: asks something of one start, not of "
                                  "the run; give it on the command line")
            if name in values:
                raise ConfigError(f"{flag_name(name)}: given twice")
            values[name] = _typed(name, value, hints[name])
            check_value(fields[name], values[name])
        except ConfigError as error:
            raise ConfigError(f"{_where(path, text, key)}: {error}") from None
    return values, (str(table["run_id"]) if _is_run_record(table, config_cls) else "")


def _read_text(path: str) -> str:
    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigError(f"--config {path}: is a folder, not a file (a run folder's config "
                          f"is {file / 'config.json'})")
    if file.suffix not in (".toml", ".json"):
        raise ConfigError(f"--config {path}: expected a .toml or .json file")
    try:
        data = _read_regular_file(file, path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror})") from None
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {error.start})") from None


def _read_regular_file(file: Path, path: str) -> bytes:
    """The bytes of ``file``, a regular file (a link to one too) of at most ``MAX_BYTES``.
    Opened without waiting (a FIFO would block the open until a writer came) and checked
    on the open descriptor: a device such as /dev/zero never ends, a FIFO may never
    answer."""
    descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as stream:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"--config {path}: not a regular file (a {_file_kind(mode)}); "
                              "give a .toml or .json file")
        data = stream.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"--config {path}: larger than {MAX_BYTES // 2**20} MiB, the most a "
                          "config file may hold (its keys take a few KiB)")
    return data


def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISCHR: "character device", stat.S_ISBLK: "block device",
             stat.S_ISFIFO: "FIFO", stat.S_ISSOCK: "socket"}
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def _parse(path: str, text: str) -> dict[str, Any]:
    """The top-level table of ``text``; ConfigError with the line of a syntax error. Both
    parsers recurse once per nested array or table: thousands of brackets inside each
    other exhaust Python's stack (a RecursionError), where a config file's values are flat."""
    kind = "TOML" if path.endswith(".toml") else "JSON"
    try:
        return _parse_as(kind, path, text)
    except RecursionError:
        raise ConfigError(f"{path}: arrays or tables nested too deeply to read as {kind}; a "
                          "config file's values are flat (numbers, strings, true or false)"
                          ) from None


def _parse_as(kind: str, path: str, text: str) -> dict[str, Any]:
    if kind == "TOML":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            message = str(error)
            at = _TOML_LINE.search(message)
            if at is None:
                raise ConfigError(f"{path}: not valid TOML: {message}") from None
            raise ConfigError(f"{path}:{at[1]}: not valid TOML: {message[:at.start()]} "
                              f"(column {at[2]})") from None
    try:
        table = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}: not valid JSON: {error.msg} (column "
                          f"{error.colno})") from None
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: the top level must be an object of keys, got "
                          f"{_kind(table)}")
    return table


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last one silently)."""
    table: dict[str, Any] = {}
    for key, value in pairs:
        if key in table:
            raise ConfigError(f"{flag_name(key.replace('-', '_'))}: given twice")
        table[key] = value
    return table


def _keys_of(table: dict[str, Any], config_cls: type) -> tuple[dict[str, Any], list[str]]:
    """The keys of a config file, and what of a run folder's config.json was left out."""
    if not _is_run_record(table, config_cls):
        return table, []
    outside = {key: value for key, value in table.items()
               if key != "config" and key not in RUN_RECORD}
    keys = {key: value for key, value in table["config"].items() if key not in RUN_PLACE}
    ignored = ([key for key in table if key in RUN_RECORD]
               + [key for key in table["config"] if key in RUN_PLACE])
    return {**outside, **keys}, ignored


def _is_run_record(table: dict[str, Any], config_cls: type) -> bool:
    """A run folder's config.json: its keys under ``config`` beside the run's id (unless the
    recipe has a key of that name)."""
    return (isinstance(table.get("config"), dict) and "run_id" in table
            and "config" not in {spec.name for spec in dataclasses.fields(config_cls)})


def _typed(name: str, value: Any, annotation: Any) -> Any:
    """``value`` as the field's type: the same types as the command line, no guessing
    (``"3"`` is not an integer); ``"none"`` or null for an optional key's no value."""
    kind, optional = base_type(annotation)
    if optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
        return None
    if isinstance(value, bool):
        if kind is bool:
            return value
    elif kind is float and isinstance(value, int | float):
        return float(value)
    elif kind in (int, str) and isinstance(value, kind):
        return value
    none = " or none" if optional else ""
    if isinstance(value, str):  # "500" looks like 500 in a message: say what it is
        shown = f"the string {value!r}" + (" (no quotes for a number or true/false)"
                                           if _reads_as(value, kind) else "")
    elif isinstance(value, int | float | bool):
        shown = _toml_value(value)
    else:
        shown = _kind(value)
    raise ConfigError(f"{flag_name(name)}: expected {_TYPE_NAMES.get(kind, kind)}{none}, "
                      f"got {shown}")


def _reads_as(text: str, kind: type) -> bool:
    """Whether ``text`` would be a value of ``kind`` written without quotes."""
    if kind is bool:
        return text in ("true", "false")
    try:
        kind(text)
    except (TypeError, ValueError):
        return False
    return kind in (int, float)


def _kind(value: Any) -> str:
    return {dict: "a table", list: "a list", type(None): "null"}.get(
        type(value), type(value).__name__)


def _where(path: str, text: str, key: str) -> str:
    """``path:line`` of ``key``'s first appearance as a key in ``text`` (a TOML line's key
    or table header, a JSON member's name), else ``path``."""
    name = re.escape(key)
    pattern = re.compile(rf'"{name}"\s*:' if path.endswith(".json") else
                         rf"^[ \t]*(\[[ \t]*)?([\"']?){name}\2[ \t]*[=\]]", re.MULTILINE)
    found = pattern.search(text)
    return f"{path}:{text.count(chr(10), 0, found.start()) + 1}" if found else path


# --- --print-config ----------------------------------------------------------------------


def config_toml(config: Any, recipe_name: str) -> str:
    """``config`` as a TOML config file: every key, in ``--help``'s groups and order, its
    help (and its default, where the value differs) as a comment above it. A key without a
    value (None, or an empty text, at its default) is commented out: read back, it takes
    the same default, and it counts as not given (an empty ``run_name`` given is refused)."""
    prog = recipes_command(recipe_name)
    lines = [f"# {prog}: the resolved config (defaults < --config file < command line).",
             f"# Run it with: {prog} --config FILE [--key value ...]",
             '# A commented-out key has no value; "none" is how a file says no value.']
    blocks: dict[str | None, list[str]] = {}
    for spec in dataclasses.fields(config):
        if spec.name in REQUESTS:
            continue
        value = getattr(config, spec.name)
        meta = spec.metadata
        about = meta["help"] + (f" [{' | '.join(str(c) for c in meta['choices'])}]"
                                if meta.get("choices") else "")
        if value != spec.default and spec.default != "":  # an empty default: the help says
            about += f" (default: {_toml_value(spec.default)})"
        unset = value in (None, "") and value == spec.default
        block = blocks.setdefault(group_of(type(config), spec.name), [""])
        block += textwrap.wrap(about, _WIDTH, initial_indent="# ", subsequent_indent="# ",
                               break_on_hyphens=False)
        block.append(f"{'# ' if unset else ''}{spec.name} = {_toml_value(value)}")
    own = blocks.pop(None, [])
    for heading, block in [*blocks.items(), (f"{recipe_name} (the recipe's own keys)", own)]:
        if block:
            lines += ["", f"# ==== {heading} ====", *block[1:]]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A TOML scalar: a basic string (quotes, backslashes and control characters escaped),
    an integer, a float (``repr``, which reads back to the same float), a boolean; None as
    ``"none"``."""
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F
                          else "\\" + char if char in '"\\' else char for char in value)
        return f'"{escaped}"'
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")
