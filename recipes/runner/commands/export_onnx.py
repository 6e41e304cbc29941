"""``export --format onnx``: the ``torch.export`` program that ``pt2`` writes, converted by
torch's ONNX exporter (which needs ``onnxscript``) and checked with ``onnxruntime``. These
packages are the optional ``onnx`` extra, so the command says how to install them when one is
missing instead of failing on an import.
"""

import importlib

import torch

from recipes.runner.config.command_line import ConfigError

NEEDED = ("onnx", "onnxscript", "onnxruntime")
INSTALL = "pip install -e '.[onnx]'"


def require_onnx() -> None:
    """A one-line ``ConfigError`` naming the extra when any package it installs is missing."""
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"export --format onnx: needs {', '.join(NEEDED)} ({name} is not "
                              f"installed): {INSTALL}") from None


def to_onnx(program: torch.export.ExportedProgram) -> bytes:
    """The serialised ONNX model of ``program``; its dynamic dimensions stay dynamic. One
    protobuf, weights inside: enough for these recipes' models (protobuf's limit is 2 GB)."""
    with torch.no_grad():
        converted = torch.onnx.export(program, dynamo=True, verbose=False)
    return converted.model_proto.SerializeToString()


def run_onnx(model: bytes, inputs: torch.Tensor) -> torch.Tensor:
    """``model``'s output on ``inputs`` under onnxruntime, on the CPU."""
    import onnxruntime  # the optional extra: imported once require_onnx found it

    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: inputs.cpu().contiguous().numpy()}
    (output,) = session.run(None, feed)
    return torch.from_numpy(output)


def largest_onnx_difference(model: torch.nn.Module, onnx_model: bytes,
                            inputs: torch.Tensor) -> float:
    with torch.no_grad():
        expected = model(inputs).float().cpu()
    return float((run_onnx(onnx_model, inputs).float() - expected).abs().max())
