"""Device and precision resolution, autocast dtypes and the scaler each precision gets."""

import re

import pytest
import torch
import torch.nn.functional as F

from engine.precision import resolve_device, resolve_precision
from engine.trainer import create_trainer

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


def test_the_device_defaults_to_the_cpu():
    assert resolve_precision("fp32") == resolve_precision("fp32", "cpu")


@pytest.mark.parametrize("device", ["tpu", "not a device"])
def test_an_unknown_device_is_refused_with_the_whole_allowed_list(device):
    allowed = "allowed: 'cpu', 'cuda', 'cuda:N', 'auto'"
    with pytest.raises(ValueError, match=rf"^device='{device}' is not .*; {allowed}$"):
        resolve_device(device)


@pytest.fixture
def fake_gpus(monkeypatch):
    """CUDA as the functions see it on a host with two GPUs: ``native_bf16`` like an A100,
    otherwise a T4, whose bf16 is only emulated (``torch.cuda.is_bf16_supported`` answers
    True for it only with ``including_emulation`` left on)."""

    def install(native_bf16: bool) -> None:
        name = "NVIDIA A100" if native_bf16 else "Tesla T4"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported",
            lambda including_emulation=True: native_bf16 or bool(including_emulation),
        )

    return install


@pytest.mark.parametrize(
    ("native_bf16", "precision", "device", "expected"),
    [
        (True, "auto", "auto", ("cuda", "bf16")),
        (False, "auto", "cuda", ("cuda", "fp16")),
        (True, "auto", "cuda:1", ("cuda:1", "bf16")),
        (False, "fp16", "cuda:0", ("cuda:0", "fp16")),
        (False, "fp32", "cuda", ("cuda", "fp32")),
        (True, "bf16", "cuda", ("cuda", "bf16")),
    ],
)
def test_precision_decisions_on_a_cuda_host(fake_gpus, native_bf16, precision, device, expected):
    fake_gpus(native_bf16)
    resolved = resolve_precision(precision, device)
    assert (resolved.device, resolved.name) == (torch.device(expected[0]), expected[1])


def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(fake_gpus):
    fake_gpus(native_bf16=False)
    message = (
        "precision='bf16' but Tesla T4 has no bf16 support; allowed here: 'fp32', 'fp16', 'auto'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_precision("bf16", "cuda")


@pytest.mark.parametrize("device", ["cuda:2", "cuda:7"])
def test_a_cuda_index_past_the_last_gpu_is_refused(fake_gpus, device):
    fake_gpus(native_bf16=True)
    message = f"device='{device}' but only 2 CUDA device(s) exist (cuda:0 .. cuda:1)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_device(device)


def test_the_scaler_belongs_to_the_precisions_device():
    scaler = resolve_precision("fp16", "cpu").make_scaler()
    scaler.scale(torch.ones(()))
    scaler.update(torch.tensor(1024.0))  # GradScaler accepts a new scale on its own device only
    assert scaler.get_scale() == 1024.0
