"""``export --format onnx`` on tiny runs of every recipe: under onnxruntime the ONNX file gives
the evaluator's outputs (skipped where the optional ``onnx`` extra is not installed), keeps
charlm's dynamic batch and sequence length, and without the extra the command is one line
naming it, exit 2, with nothing written (run whether or not the extra is installed).
"""

import json
import sys
import types

import pytest
import torch

from recipes.__main__ import main
from recipes.runner.commands.export_onnx import NEEDED
from recipes.runner.commands.trained import load_trained
from recipes.runner.config.registry import load_recipe
from tests.helpers import RUNS, TOLERANCE, digests, evaluation, one_error_line

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def needs_the_onnx_extra() -> None:
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)


def onnx_session(path):
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_session(session, inputs: torch.Tensor) -> torch.Tensor:
    """The session's outputs as the evaluator's: charlm's logits one row per byte."""
    (output,) = session.run(None, {session.get_inputs()[0].name: inputs.contiguous().numpy()})
    outputs = torch.from_numpy(output)
    return outputs.flatten(0, 1) if outputs.ndim == 3 else outputs


@pytest.mark.parametrize("run", RUNS)
def test_onnx_gives_the_evaluators_outputs_under_onnxruntime(run, request, capsys):
    needs_the_onnx_extra()
    run_dir, recipe = request.getfixturevalue(run), run.removesuffix("_run")
    before = digests(run_dir, "export")
    assert main([recipe, "export", str(run_dir), "--format", "onnx"]) == 0
    assert "largest |difference| under onnxruntime" in capsys.readouterr().out
    assert digests(run_dir, "export") == before  # only export/ was written
    session = onnx_session(run_dir / "export" / "best.onnx")
    inputs, expected = evaluation(recipe, run_dir)
    largest = float(max((run_session(session, x) - y).abs().max() for x, y in zip(
        inputs, expected, strict=True)))
    print(f"{recipe}: largest |onnxruntime - evaluator| {largest:.3g}")
    # Measured: cifar 1.6e-6, images 8.9e-8, charlm 4.8e-7 (onnxruntime's kernels, not torch's).
    assert largest <= TOLERANCE
    facts = json.loads((run_dir / "export" / "best.onnx.json").read_text())
    assert facts["recipe"] == recipe and facts["checkpoint"].endswith("best.pt")
    assert facts["input"]["shape"][0] == "batch"
    assert facts["input"]["dtype"] == ("int64" if recipe == "charlm" else "float32")
    assert isinstance(session.get_inputs()[0].shape[0], str)  # dynamic in the ONNX graph


def test_onnx_of_charlm_takes_any_batch_and_length_up_to_the_block_size(request, tmp_path):
    needs_the_onnx_extra()
    run_dir = request.getfixturevalue("charlm_run")
    out = tmp_path / "gpt.onnx"
    assert main(["charlm", "export", str(run_dir), "--out", str(out), "--format", "onnx"]) == 0
    facts = json.loads((tmp_path / "gpt.onnx.json").read_text())
    assert facts["input"]["shape"] == ["batch", "time"] and facts["block_size"] == 8
    session = onnx_session(out)
    model = load_trained(load_recipe("charlm"), str(run_dir)).parts.model
    for shape in ((1, 1), (3, 5), (2, 8)):
        ids = torch.randint(256, shape, generator=torch.Generator().manual_seed(0))
        (logits,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(logits), model(ids), rtol=0,
                                       atol=TOLERANCE)


@pytest.mark.parametrize("missing", NEEDED)
def test_without_the_onnx_extra_it_is_one_line_naming_it_exit_2_and_writes_nothing(
        missing, request, tmp_path, monkeypatch, capsys):
    run_dir = request.getfixturevalue("cifar_run")
    # The packages before it stand in as importable, so the test is the same with or without
    # the extra installed; the missing one's import raises ImportError.
    for name in NEEDED[:NEEDED.index(missing)]:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, missing, None)
    before = digests(run_dir)
    for args in ([], ["--out", str(tmp_path / "model.onnx")]):
        code = main(["cifar", "export", str(run_dir), "--format", "onnx", *args])
        one_error_line(code, capsys.readouterr().err, f"{missing} is not installed",
                       "pip install -e '.[onnx]'")
    assert digests(run_dir) == before and not list(tmp_path.iterdir())
