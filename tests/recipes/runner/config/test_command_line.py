import dataclasses
import inspect
from dataclasses import dataclass

import pytest
import torch

from handlers.spike_guard import SpikeGuard
from recipes.runner.config.command_line import (
    ConfigError,
    field,
    group_of,
    group_values,
    help_text,
    parse_args,
    resume_overrides,
    validate,
)
from recipes.runner.config.run_keys import MAX_SEED, RunConfig


def _even(value: int) -> str | None:
    return None if value % 2 == 0 else f"must be even, got {value}"


@dataclass
class Sample:
    steps: int = field(10, "optimizer steps", min=1)
    lr: float = field(0.1, "learning rate", min=0, min_exclusive=True, max=10)
    clip: float | None = field(None, "clip norm (none: off)", min=0, min_exclusive=True)
    shuffle: bool = field(True, "shuffle the data")
    mode: str = field("fast", "how to run", choices=("fast", "slow"))
    width: int = field(4, "layer width", check=_even, fixed_on_resume=True)
    batch_size: int = field(32, "samples per batch", min=1, fixed_on_resume=True)


def test_defaults_when_nothing_is_given():
    config, given = parse_args(Sample, [])
    assert config == Sample() and given == set()


def test_values_are_converted_to_the_field_types():
    config, given = parse_args(Sample, ["--steps", "5", "--lr", "0.5", "--clip", "2",
                                        "--mode", "slow", "--batch-size", "8"])
    assert (config.steps, config.lr, config.clip, config.mode, config.batch_size) == (
        5, 0.5, 2.0, "slow", 8)
    assert type(config.steps) is int and type(config.lr) is float and type(config.clip) is float
    assert given == {"steps", "lr", "clip", "mode", "batch_size"}


def test_key_equals_value_form_matches_the_two_token_form():
    assert parse_args(Sample, ["--lr=0.5", "--batch-size=8"]) == parse_args(
        Sample, ["--lr", "0.5", "--batch-size", "8"])


def test_equals_form_keeps_everything_after_the_first_equals_sign():
    config, _ = parse_args(Sample, ["--mode=fast"])
    assert config.mode == "fast"
    with pytest.raises(ConfigError, match="--mode: 'a=b' is not allowed"):
        parse_args(Sample, ["--mode=a=b"])


@pytest.mark.parametrize("text", ["none", "None", "NULL", ""])
def test_an_optional_field_takes_none(text):
    config, given = parse_args(Sample, [f"--clip={text}"])
    assert config.clip is None and given == {"clip"}


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False),
])
def test_bool_words(text, expected):
    config, _ = parse_args(Sample, ["--shuffle", text])
    assert config.shuffle is expected


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1.5"], "--steps: expected an integer, got '1.5'"),
    (["--steps", "none"], "--steps: expected an integer, got 'none'"),
    (["--lr", "abc"], "--lr: expected a number, got 'abc'"),
    (["--clip", "abc"], "--clip: expected a number or none, got 'abc'"),
    (["--shuffle", "maybe"], "--shuffle: expected true or false, got 'maybe'"),
])
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_args(Sample, argv)
    assert str(error.value) == message


def test_an_unknown_key_suggests_the_closest_ones():
    with pytest.raises(ConfigError) as error:
        parse_args(Sample, ["--batch-sise", "8"])
    assert str(error.value) == (
        "unknown key --batch-sise; did you mean --batch-size? (see --help for all keys)")


def test_an_unknown_key_suggests_only_the_closest():
    """``--epoch`` had suggested ``--epochs, --nproc``."""
    with pytest.raises(ConfigError) as error:
        parse_args(RunConfig, ["--epoch", "3"])
    assert str(error.value) == ("unknown key --epoch; did you mean --epochs? (see --help for "
                                "all keys)")


@pytest.mark.parametrize("argv", [["--shuffle"], ["--shuffle", "--steps", "2"],
                                  ["--steps", "2", "--shuffle"]])
def test_a_bare_switch_is_true(argv):
    config, given = parse_args(Sample, ["--shuffle", "false"])
    assert config.shuffle is False
    config, given = parse_args(Sample, argv)
    assert config.shuffle is True and "shuffle" in given


def test_an_unknown_key_with_nothing_close_has_no_suggestion():
    with pytest.raises(ConfigError) as error:
        parse_args(Sample, ["--zzzzzz", "1"])
    assert "did you mean" not in str(error.value) and "--zzzzzz" in str(error.value)


def test_underscores_in_a_flag_are_accepted_like_dashes():
    config, given = parse_args(Sample, ["--batch_size", "8"])
    assert config.batch_size == 8 and given == {"batch_size"}


@pytest.mark.parametrize("argv", [["--steps", "1", "--steps", "2"], ["--steps=1", "--steps", "1"],
                                  ["--batch-size", "8", "--batch_size=8"]])
def test_a_key_given_twice_is_refused(argv):
    with pytest.raises(ConfigError, match=r"given twice"):
        parse_args(Sample, argv)


@pytest.mark.parametrize("argv, message", [
    (["--steps"], "--steps: missing value"),
    (["--steps", "--lr", "1"], "--steps: missing value"),
    (["steps", "1"], "unexpected argument 'steps'"),
    (["-s", "1"], "unexpected argument '-s'"),
    (["--"], "unexpected argument '--'"),
])
def test_malformed_argument_lists(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(Sample, argv)


def test_a_negative_number_is_a_value_not_a_flag():
    with pytest.raises(ConfigError, match=r"^--lr: must be > 0, got -1.0$"):
        parse_args(Sample, ["--lr", "-1"])


@pytest.mark.parametrize("changes, message", [
    ({"steps": 0}, "--steps: must be >= 1, got 0"),
    ({"lr": 0.0}, "--lr: must be > 0, got 0.0"),
    ({"lr": 10.5}, "--lr: must be <= 10, got 10.5"),
    ({"lr": float("nan")}, "--lr: must be a finite number, got nan"),
    ({"lr": float("inf")}, "--lr: must be a finite number, got inf"),
    ({"clip": 0.0}, "--clip: must be > 0, got 0.0"),
    ({"mode": "medium"}, "--mode: 'medium' is not allowed; choose one of: fast, slow"),
    ({"width": 3}, "--width: must be even, got 3"),
])
def test_validate_names_the_key_and_what_is_allowed(changes, message):
    with pytest.raises(ConfigError) as error:
        validate(dataclasses.replace(Sample(), **changes))
    assert str(error.value) == message


@pytest.mark.parametrize("argv, message", [
    (["--run-dir", "runs/a\udcffb"],  # the byte 0xff on a command line, as Python holds it
     "--run-dir: must be UTF-8 text, got the bytes b'runs/a\\xffb'"),
    (["--run-name", "a\x00b"], "--run-name: must not hold a NUL byte, got 'a\\x00b'"),
    (["--seed", "99999999999999999999"],
     "--seed: must be <= 18446744073709551615, got 99999999999999999999"),
])
def test_text_and_seeds_that_the_os_or_torch_would_refuse_are_one_line(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_args(RunConfig, argv)
    assert str(error.value) == message


def test_the_largest_seed_is_the_largest_torch_takes():
    config, _ = parse_args(RunConfig, ["--seed", str(MAX_SEED)])
    torch.Generator().manual_seed(config.seed)
    with pytest.raises(ValueError, match="Overflow"):
        torch.Generator().manual_seed(MAX_SEED + 1)


def test_validate_accepts_the_bounds_and_none():
    validate(dataclasses.replace(Sample(), steps=1, lr=10.0, clip=None))


def test_parse_args_validates_after_converting():
    with pytest.raises(ConfigError, match=r"^--lr: must be a finite number, got inf$"):
        parse_args(Sample, ["--lr=inf"])


def test_help_lists_every_key_with_its_default_help_and_choices():
    text = help_text(Sample, "prog", "what it does", "sample")
    assert text.startswith("usage: prog [--key value ...]") and "what it does" in text
    for spec in dataclasses.fields(Sample):
        line = next(line for line in text.splitlines()
                    if line.split()[:1] == ["--" + spec.name.replace("_", "-")])
        assert spec.metadata["help"] in line
    assert "[fast | slow]" in text
    lines = {line.split()[0]: line.split()[1] for line in text.splitlines()
             if line.startswith("  --")}
    # As the command line and config files spell them, not Python's None and True.
    assert lines["--clip"] == "none" and lines["--shuffle"] == "true" and lines["--steps"] == "10"


@dataclass
class Task(RunConfig):
    """A recipe's config: its own keys, and a run key declared again for another default."""

    epochs: int = field(3, "epochs to train", min=1)
    width: int = field(4, "layer width", min=1)
    depth: int = field(2, "layers", min=1)


RUN_GROUPS = ["run", "schedule", "precision", "checkpoints", "health", "spike", "distributed",
              "tracking"]


def _help_blocks(text: str) -> dict[str, list[str]]:
    """{heading: the flags listed under it}, in the order of the headings."""
    blocks: dict[str, list[str]] = {}
    for line in text.split("keys (default, meaning)", 1)[1].splitlines()[1:]:
        if line.endswith(":") and not line.startswith(" "):
            heading = blocks.setdefault(line[:-1], [])
        elif line.startswith("  --"):  # not a meaning's continuation
            heading.append(line.split()[0])
    return blocks


def test_help_lists_the_run_groups_in_order_then_the_recipes_own_keys():
    blocks = _help_blocks(help_text(Task, "prog", "what it does", "task"))
    assert list(blocks) == [*RUN_GROUPS, "task (the recipe's own keys)"]
    assert blocks["task (the recipe's own keys)"] == ["--width", "--depth"]
    listed = [flag for flags in blocks.values() for flag in flags]
    assert sorted(listed) == sorted("--" + f.name.replace("_", "-")
                                    for f in dataclasses.fields(Task))


@pytest.mark.parametrize("group, flags", [
    ("run", ["--epochs", "--batch-size", "--lr", "--seed", "--device", "--run-name"]),
    ("schedule", ["--scheduler", "--warmup-fraction", "--min-lr-ratio"]),
    ("precision", ["--precision"]),
    ("checkpoints", ["--resume", "--checkpoint-every", "--keep-last"]),
    ("health", ["--checks", "--patience", "--spike-guard"]),
    ("spike", ["--spike-factor", "--spike-window", "--spike-watch", "--spike-max-rollbacks"]),
    ("distributed", ["--nproc", "--backend"]),
])
def test_help_lists_each_run_key_under_its_group(group, flags):
    blocks = _help_blocks(help_text(Task, "prog", "what it does", "task"))
    assert set(flags) <= set(blocks[group])


def test_a_redeclared_run_key_keeps_its_group_and_its_new_default():
    assert group_of(Task, "epochs") == "run" and group_of(Task, "width") is None
    line = next(line for line in help_text(Task, "prog", "", "task").splitlines()
                if line.split()[:1] == ["--epochs"])
    assert line.split()[1] == "3"


def test_group_values_are_the_groups_keys_without_the_prefix():
    config, _ = parse_args(Task, ["--spike-window", "7", "--scheduler", "cosine"])
    spike = group_values(config, "spike")
    assert spike["window"] == 7 and spike["watch"] == "both" and "guard" not in spike
    assert group_values(config, "schedule")["scheduler"] == "cosine"
    assert group_values(config, "precision") == {"precision": "auto"}


def test_the_spike_keys_are_spike_guards_arguments():
    """Every --spike-<name> is SpikeGuard's argument <name>: a key or an argument renamed
    on one side only fails here."""
    arguments = set(inspect.signature(SpikeGuard).parameters)
    assert set(group_values(RunConfig(), "spike")) == arguments


def test_spike_guard_takes_the_spike_keys_unchanged():
    config, _ = parse_args(RunConfig, ["--spike-window", "7", "--spike-min-history", "3",
                                       "--spike-watch", "loss", "--spike-factor", "4"])
    guard = SpikeGuard(**group_values(config, "spike"))
    assert (guard.window, guard.min_history, guard.watch, guard.factor) == (7, 3, ("loss",), 4.0)


@pytest.mark.parametrize("watch, watched", [("both", ("loss", "grad_norm")),
                                            ("loss", ("loss",)), ("grad_norm", ("grad_norm",))])
def test_every_spike_watch_choice_is_one_spike_guard_accepts(watch, watched):
    config, _ = parse_args(RunConfig, ["--spike-watch", watch])
    assert SpikeGuard(**group_values(config, "spike")).watch == watched


def _saved(**changes) -> dict:
    return dataclasses.asdict(dataclasses.replace(Sample(), **changes))


def test_resume_takes_keys_not_given_from_the_saved_run():
    config, given = parse_args(Sample, [])
    settled, messages = resume_overrides(_saved(steps=7, lr=0.3, width=8), config, given)
    assert messages == []
    assert (settled.steps, settled.lr, settled.width) == (7, 0.3, 8)
    assert config == Sample()  # the given config is not written


def test_resume_reports_each_changed_key_that_was_given():
    config, given = parse_args(Sample, ["--steps", "20", "--lr", "0.3", "--width", "8"])
    settled, messages = resume_overrides(_saved(steps=10, lr=0.3, width=8), config, given)
    assert messages == ["override: steps 10 -> 20"]
    assert (settled.steps, settled.lr) == (20, 0.3)


def test_resume_refuses_to_change_a_fixed_key():
    config, given = parse_args(Sample, ["--batch-size", "16"])
    with pytest.raises(ConfigError) as error:
        resume_overrides(_saved(batch_size=32), config, given)
    message = str(error.value)
    assert message.startswith("--batch-size: cannot change on resume (32 -> 16)")
    assert "\n" not in message


def test_resume_allows_a_fixed_key_given_with_its_saved_value():
    config, given = parse_args(Sample, ["--batch-size", "32", "--width", "4"])
    assert resume_overrides(_saved(), config, given)[1] == []


def test_resume_ignores_keys_the_saved_run_did_not_have():
    config, given = parse_args(Sample, ["--steps", "3"])
    saved = _saved(lr=0.2)
    del saved["steps"]
    settled, messages = resume_overrides(saved, config, given)
    assert messages == [] and (settled.steps, settled.lr) == (3, 0.2)


def test_resume_validates_the_merged_config():
    config, given = parse_args(Sample, [])
    with pytest.raises(ConfigError, match="--mode: 'turbo' is not allowed"):
        resume_overrides(_saved(mode="turbo"), config, given)


def test_the_run_keys_choices_are_those_of_the_engine_and_the_handlers():
    """run_config spells these out so that it imports no torch; a choice added on one side
    only fails here."""
    from engine.precision import PRECISIONS
    from handlers.lr_scheduling import SCHEDULER_NAMES
    from handlers.spike_guard import WATCH_CHOICES
    from recipes.runner.config import run_keys as run_config

    assert run_config.PRECISIONS == PRECISIONS
    assert run_config.SCHEDULER_NAMES == SCHEDULER_NAMES
    assert run_config.WATCH_CHOICES == WATCH_CHOICES


def test_no_before_a_switch_gets_the_spelling_that_turns_it_off():
    with pytest.raises(ConfigError, match=r"^unknown key --no-shuffle; to turn --shuffle off, "
                                          r"say --shuffle false \(see --help for all keys\)$"):
        parse_args(Sample, ["--no-shuffle"])
    with pytest.raises(ConfigError, match=r"^unknown key --no-steps; did you mean --steps\?"):
        parse_args(Sample, ["--no-steps", "3"])  # not a switch: the nearest keys


def test_help_wraps_long_meanings_under_their_first_character():
    @dataclass
    class Wordy:
        depth: int = field(2, " ".join(["layers"] * 30))

    lines = help_text(Wordy, "prog", "", "wordy", width=60).splitlines()
    entry = lines[next(i for i, line in enumerate(lines) if line.startswith("  --depth")):]
    assert entry[0].startswith("  --depth  2  layers")
    assert len(entry) > 2 and all(len(line) <= 60 for line in entry)
    assert all(line.startswith(" " * len("  --depth  2  ") + "layers") for line in entry[1:])
    assert " ".join(line.split("  ")[-1].strip() for line in entry) == " ".join(["layers"] * 30)


def test_help_shows_an_example():
    assert help_text(Sample, "prog", "", "sample").splitlines()[1] == (
        "example: prog --epochs 2 --run-name first-try")
