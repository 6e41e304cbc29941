"""``python -m recipes <recipe> export`` end to end on tiny runs of every recipe: the ``.pt2``
program gives the evaluator's outputs (its forward without test-time augmentation) and loads in
a Python that cannot import this project; the ``.safetensors`` file holds exactly the weights
the run evaluated and loads into the recipe's model class from its JSON's facts; every bad run,
checkpoint or option is one line and exit 2, with nothing written.
"""

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from recipes.__main__ import main
from recipes.charlm.model import GPT
from recipes.cifar.model import build_model
from recipes.images.recipe import build_classifier
from recipes.runner.commands.trained import load_trained
from recipes.runner.config.registry import load_recipe
from tests.helpers import (
    CIFAR_RUN,
    MODEL_INPUT,
    RUNS,
    TOLERANCE,
    copy_run,
    digests,
    evaluation,
    one_error_line,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

# Run as `python -I -S` (no PYTHONPATH, no site-packages, so not the editable install either)
# from an empty folder: only torch's own folders are put on sys.path.
LOAD_WITHOUT_THE_PROJECT = """
import importlib.util, sys
sys.path.extend(sys.argv[4:])
for name in ("engine", "handlers", "recipes"):
    assert importlib.util.find_spec(name) is None, name
import torch
program = torch.export.load(sys.argv[1]).module()
with torch.no_grad():
    outputs = [program(x) for x in torch.load(sys.argv[2])]
torch.save(outputs, sys.argv[3])
"""


def run_program(program: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The program's outputs as the evaluator's: charlm's logits one row per byte."""
    with torch.no_grad():
        outputs = program(inputs)
    return outputs.flatten(0, 1) if outputs.ndim == 3 else outputs


@pytest.mark.parametrize("run", RUNS)
def test_pt2_gives_the_evaluators_outputs(run, request, capsys):
    run_dir, recipe = request.getfixturevalue(run), run.removesuffix("_run")
    before = digests(run_dir, "export")
    assert main([recipe, "export", str(run_dir)]) == 0
    assert "largest |difference| from the model" in capsys.readouterr().out
    assert digests(run_dir, "export") == before  # only export/ was written
    program = torch.export.load(run_dir / "export" / "best.pt2").module()
    inputs, expected = evaluation(recipe, run_dir)
    differences = [(run_program(program, x) - y).abs().max() for x, y in zip(
        inputs, expected, strict=True)]
    largest = float(max(differences))
    print(f"{recipe}: largest |export - evaluator| {largest:.3g}")
    assert largest <= TOLERANCE
    facts = json.loads((run_dir / "export" / "best.pt2.json").read_text())
    assert facts["recipe"] == recipe and facts["checkpoint"].endswith("best.pt")
    assert facts["input"]["shape"][0] == "batch"
    assert facts["input"]["dtype"] == ("int64" if recipe == "charlm" else "float32")
    # The JSON says what torch does not let a reader change: the module's mode.
    assert facts["mode"] == "eval"
    with pytest.raises(NotImplementedError):
        program.eval()
    mask = os.umask(0o022)
    os.umask(mask)
    assert {path.name: path.stat().st_mode & 0o777 for path in (run_dir / "export").iterdir()
            } == {"best.pt2": 0o666 & ~mask, "best.pt2.json": 0o666 & ~mask}  # as open makes


def test_pt2_of_charlm_takes_any_batch_and_length_up_to_the_block_size(request, tmp_path):
    run_dir = request.getfixturevalue("charlm_run")
    out = tmp_path / "gpt.pt2"
    assert main(["charlm", "export", str(run_dir), "--out", str(out)]) == 0
    facts = json.loads((tmp_path / "gpt.pt2.json").read_text())
    assert facts["input"]["shape"] == ["batch", "time"] and facts["block_size"] == 8
    program = torch.export.load(out).module()
    model = load_trained(load_recipe("charlm"), str(run_dir)).parts.model
    for shape in ((1, 1), (3, 5), (2, 8)):
        ids = torch.randint(256, shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(program(ids), model(ids), rtol=0, atol=TOLERANCE)
    with pytest.raises(Exception, match=r"size\(\)\[1\] <= 8"):
        program(torch.zeros(1, 9, dtype=torch.int64))  # longer than the block size


@pytest.mark.parametrize("run", RUNS)
def test_pt2_loads_and_runs_in_a_python_without_the_project(run, request, tmp_path):
    run_dir, recipe = request.getfixturevalue(run), run.removesuffix("_run")
    out = tmp_path / "model.pt2"
    assert main([recipe, "export", str(run_dir), "--checkpoint", "last", "--out", str(out)]) == 0
    trained = load_trained(load_recipe(recipe), str(run_dir), "last")
    batch = next(iter(trained.parts.val_batches))
    first = MODEL_INPUT[recipe](trained.parts.prepare_batch(batch, trained.device, False))
    inputs = [first, first[:1]]  # the batch dimension is dynamic
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "empty").mkdir()
    torch_folders = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", LOAD_WITHOUT_THE_PROJECT, str(out),
         str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"), *torch_folders],
        cwd=tmp_path / "empty", env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    with torch.no_grad():
        for x, y in zip(inputs, outputs, strict=True):
            torch.testing.assert_close(y, trained.parts.model(x), rtol=0, atol=TOLERANCE)


def rebuild(facts: dict) -> torch.nn.Module:
    """The recipe's model class from an export's JSON, as a user would build it."""
    if facts["recipe"] == "cifar":
        return build_model(facts["model"], facts["num_classes"])
    if facts["recipe"] == "images":
        return build_classifier(facts["model"], facts["num_classes"],
                                small_images=facts["stem"] == "cifar")
    return GPT(facts["vocab_size"], facts["block_size"], facts["n_layer"], facts["n_head"],
               facts["n_embd"])


@pytest.mark.parametrize("run", RUNS)
def test_safetensors_hold_the_checkpoints_weights_and_rebuild_the_model(run, request):
    run_dir, recipe = request.getfixturevalue(run), run.removesuffix("_run")
    before = digests(run_dir, "export")
    assert main([recipe, "export", str(run_dir), "--format", "safetensors"]) == 0
    assert digests(run_dir, "export") == before
    weights = load_file(run_dir / "export" / "best.safetensors")
    saved = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert weights.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    facts = json.loads((run_dir / "export" / "best.safetensors.json").read_text())
    model = rebuild(facts)
    model.load_state_dict(weights)  # strict: every key, every shape
    # The file alone says the same: the JSON's facts are its metadata, each as JSON text.
    with safe_open(run_dir / "export" / "best.safetensors", "pt") as file:
        assert {key: json.loads(value) for key, value in file.metadata().items()} == facts
    if recipe != "charlm":
        trained = load_trained(load_recipe(recipe), str(run_dir))
        classes = trained.data.classes if recipe == "cifar" else trained.data.folders.classes
        assert facts["classes"] == list(classes) and len(facts["mean"]) == 3
        assert facts["image_size"] == (32 if recipe == "cifar" else trained.data.image_size)


def test_safetensors_of_an_ema_run_hold_the_averaged_weights(tmp_path):
    run_dir = train([*CIFAR_RUN, "--averaging", "ema", "--ema-decay", "0.5", "--lookahead", "false",
                     "--tta", "none", "--final-tta", "none"], tmp_path / "ema")
    out = tmp_path / "ema.safetensors"
    assert main(["cifar", "export", str(run_dir), "--format", "safetensors",
                 "--out", str(out)]) == 0
    averaged = torch.load(run_dir / "checkpoints" / "best.pt",
                          weights_only=True)["averaging"]["averaged_model"]
    weights = load_file(out)
    assert all(torch.equal(weights[name], tensor) for name, tensor in averaged.items())


def test_bad_runs_checkpoints_and_options_are_one_line_exit_2_and_write_nothing(
        request, tmp_path, capsys):
    cifar, charlm = map(request.getfixturevalue, ("cifar_run", "charlm_run"))
    bad = copy_run(cifar, tmp_path / "bad", lambda path: path.startswith("checkpoints/"),
                   hard_links=False)
    corrupt, truncated = bad / "checkpoints" / "best.pt", bad / "checkpoints" / "last.pt"
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    no_best = copy_run(cifar, tmp_path / "no_best",
                       lambda path: path.startswith("checkpoints/") and "best" not in path)
    best = cifar / "checkpoints" / "best.pt"
    cases = [
        (["cifar", str(tmp_path / "nowhere")], "no such run folder or checkpoint file"),
        (["images", str(best)], "not a checkpoint of the images recipe"),
        (["cifar", str(charlm)], "not a checkpoint of the cifar recipe"),
        (["cifar", str(corrupt)], "checksum mismatch"),
        (["cifar", str(truncated)], "truncated"),
        (["cifar", str(no_best)], "best.pt: no such checkpoint"),
        (["cifar", str(cifar), "--format", "tflite"], "--format: invalid choice: 'tflite'"),
        (["cifar", str(cifar), "--out", str(tmp_path / "x.pt")], "must end in .pt2"),
        (["cifar", str(cifar), "--format", "safetensors", "--out",
          str(tmp_path / "x.pt2")], "must end in .safetensors"),
        (["cifar", str(cifar), "--out", str(tmp_path / "missing" / "x.pt2")],
         "does not exist"),
    ]
    before = digests(cifar)
    for (recipe, *args), fragment in cases:
        code = main([recipe, "export", *args])
        one_error_line(code, capsys.readouterr().err, fragment)
    assert digests(cifar) == before
    assert not any(path.name == "export" or path.suffix in {".pt2", ".safetensors"}
                   for path in tmp_path.rglob("*"))
