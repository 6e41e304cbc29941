"""``--search KEY=SPEC``: the grammar, the types the keys keep, and every refusal in one line
naming what is allowed."""

import pytest

from recipes.charlm.config import Config as CharLMConfig
from recipes.runner.config.command_line import ConfigError
from recipes.runner.sweep.search_space import parse_search, parse_searches


class Suggests:
    """What a trial's suggest_* calls ask for: (kind, name, arguments)."""

    def suggest_float(self, name, low, high, log=False):
        return ("float", name, low, high, log)

    def suggest_int(self, name, low, high, log=False):
        return ("int", name, low, high, log)

    def suggest_categorical(self, name, choices):
        return ("categorical", name, choices)


@pytest.mark.parametrize(("text", "asked"), [
    ("lr=1e-4:1e-1:log", ("float", "lr", 1e-4, 1e-1, True)),
    ("--lr=0.01:0.5", ("float", "lr", 0.01, 0.5, False)),
    ("n-layer=1:4", ("int", "n_layer", 1, 4, False)),
    ("batch_size=16:256:log", ("int", "batch_size", 16, 256, True)),
    ("weight-decay=0,0.01,0.1", ("categorical", "weight_decay", [0.0, 0.01, 0.1])),
    ("compile=true,false", ("categorical", "compile", [True, False])),
    ("scheduler=cosine,onecycle", ("categorical", "scheduler", ["cosine", "onecycle"])),
    ("max-grad-norm=none,1.0", ("categorical", "max_grad_norm", [None, 1.0])),
])
def test_a_spec_asks_optuna_for_the_keys_own_type(text, asked):
    assert parse_search(CharLMConfig, text).suggest(Suggests()) == asked


@pytest.mark.parametrize(("texts", "fragments"), [
    (["lrr=1e-4:1e-1"], ("unknown key --lrr", "did you mean --lr?")),
    (["lr"], ("give KEY=SPEC", "LOW:HIGH, LOW:HIGH:log or A,B,C")),
    (["lr=0.1"], ("SPEC must be LOW:HIGH, LOW:HIGH:log or A,B,C", "'0.1'")),
    (["lr=1e-4:1e-1:ln"], ("SPEC must be",)),
    (["lr=1e-4:1e-1:log:2"], ("SPEC must be",)),
    (["lr=0:1e-1:log"], ("--lr: must be > 0, got 0.0",)),
    (["lr=0.1:0.01"], ("LOW must be below HIGH",)),
    (["lr=a:1"], ("--lr: expected a number, got 'a'",)),
    (["n-layer=1.5:4"], ("--n-layer: expected an integer, got '1.5'",)),
    (["n-layer=0:4"], ("--n-layer: must be >= 1, got 0",)),
    (["scheduler=cosine,linear"], ("'linear' is not allowed", "choose one of:")),
    (["scheduler=a:b"], ("--scheduler takes text, not a range", "choices A,B,C")),
    (["compile=true:false"], ("true or false, not a range",)),
    (["lr=0.1,0.1"], ("two different values",)),
    (["max-grad-norm=none:1"], ("numbers at both ends",)),
    (["run-name=a,b"], ("--run-name is not searched",)),
    (["nproc=1:2"], ("--nproc is not searched",)),
    (["lr=1e-3:1e-2", "lr=0.1,0.2"], ("--lr is searched twice",)),
])
def test_a_wrong_key_spec_or_value_is_one_line_naming_what_is_allowed(texts, fragments):
    with pytest.raises(ConfigError) as caught:
        parse_searches(CharLMConfig, texts)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--search")
    for fragment in fragments:
        assert fragment in message, message
