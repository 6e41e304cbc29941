"""Device and precision resolution, autocast dtypes and the scaler each precision gets."""

import pytest
import torch
import torch.nn.functional as F

from engine import create_trainer, resolve_device, resolve_precision

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def test_auto_precision_on_the_cpu_is_fp32():
    resolved = resolve_precision("auto", "cpu")
    assert (resolved.device, resolved.name, resolved.dtype) == (torch.device("cpu"), "fp32", None)


@no_cuda
def test_auto_device_without_cuda_is_the_cpu():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_precision("auto", "auto").name == "fp32"


@pytest.mark.parametrize(
    ("precision", "scaler_enabled"), [("fp16", True), ("bf16", False), ("fp32", False)]
)
def test_only_fp16_gets_an_enabled_scaler_on_the_cpu(precision, scaler_enabled, make_mlp):
    resolved = resolve_precision(precision, "cpu")
    assert resolved.uses_scaler is scaler_enabled
    assert resolved.make_scaler().is_enabled() is scaler_enabled

    model = make_mlp()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, precision=precision
    )
    assert trainer.precision == resolved
    assert trainer.scaler.is_enabled() is scaler_enabled


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)],
)
def test_autocast_computes_linear_layers_in_the_precision_dtype(precision, dtype, make_mlp):
    model = make_mlp()
    with resolve_precision(precision, "cpu").autocast():
        assert model(torch.randn(2, 8)).dtype == dtype


def test_unknown_precision_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"precision='fp8'.*auto, fp32, fp16, bf16"):
        resolve_precision("fp8", "cpu")


@pytest.mark.parametrize("device", ["tpu", "not a device"])
def test_unknown_device_names_the_allowed_values(device):
    with pytest.raises(ValueError, match=rf"device='{device}'.*allowed: 'cpu', 'cuda'"):
        resolve_device(device)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused(device):
    with pytest.raises(ValueError, match=rf"device='{device}'.*CUDA is not available"):
        resolve_precision("fp32", device)
