"""precision = "auto" picks what the device runs fastest, and refuses what it cannot run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpsearch.trainer import precision
from hpsearch.trainer.config import ConfigError


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, major: int) -> None:
    """torch's own bf16 check, run against a GPU of compute capability ``major``.x that can
    create bf16 tensors (as every CUDA GPU can, through emulation below Ampere)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device: SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda _device: True)


@pytest.mark.parametrize(("major", "expected"), [(7, "fp16"), (8, "bf16"), (9, "bf16")])
def test_auto_takes_bf16_only_where_the_gpu_has_it_in_hardware(
    monkeypatch: pytest.MonkeyPatch, major: int, expected: str
) -> None:
    # A V100 or T4 (7.x) "supports" bf16 by emulation, several times slower than its fp16.
    pretend_gpu(monkeypatch, major)
    assert precision.resolve("auto", torch.device("cuda")) == expected


def test_explicit_bf16_on_an_older_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, 7)
    with pytest.raises(ConfigError, match="bf16 is not supported on this GPU; use fp16 or auto"):
        precision.resolve("bf16", torch.device("cuda"))


def test_cpu_never_takes_fp16() -> None:
    assert precision.resolve("auto", torch.device("cpu")) in ("bf16", "fp32")
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU"):
        precision.resolve("fp16", torch.device("cpu"))


def _one_step(grad: float) -> tuple[torch.nn.Parameter, Any, torch.amp.GradScaler, bool]:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # a real fp16 loss scaler
    scaler.scale((weight * grad).sum()).backward()
    return weight, scheduler, scaler, precision.optimizer_step(optimizer, scheduler, scaler)


def test_a_step_the_fp16_scaler_skips_does_not_advance_the_schedule() -> None:
    weight, scheduler, scaler, applied = _one_step(float("inf"))
    assert not applied
    assert torch.equal(weight.detach(), torch.ones(2))  # no update
    assert scheduler.last_epoch == 0  # warm-up still at its first step
    assert scaler.get_scale() == 512.0  # the scaler backed off, to try again

    weight, scheduler, _, applied = _one_step(1.0)
    assert applied
    assert torch.allclose(weight.detach(), torch.full((2,), 0.99))  # lr 0.1 x warm-up 1/10
    assert scheduler.last_epoch == 1


def test_without_loss_scaling_every_step_is_applied() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = precision.grad_scaler("fp32", torch.device("cpu"))
    weight.sum().backward()
    assert precision.optimizer_step(optimizer, scheduler, scaler)
    assert scheduler.last_epoch == 1 and torch.allclose(weight.detach(), torch.full((2,), 0.9))


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    ("requested", "compute", "stored", "adapter", "expected"),
    [
        # (regime, trained, frozen, saved as, bytes a trained parameter, compensated)
        ("auto", "bf16", BF16, False, ("bf16-mixed", FP32, BF16, BF16, 16, False)),
        ("bf16", "bf16", FP32, False, ("bf16-mixed", FP32, FP32, FP32, 16, False)),
        # A T4 or V100 (no bf16) on a bf16 checkpoint: fp32 masters take fp16's loss scaling, saved bf16 again.
        ("fp16", "fp16", BF16, False, ("fp16-mixed", FP32, BF16, BF16, 16, False)),
        ("auto", "fp32", BF16, False, ("fp32", FP32, FP32, BF16, 16, False)),
        ("fp32", "fp32", BF16, True, ("fp32", FP32, FP32, BF16, 16, False)),
        ("bf16-true", "bf16", FP32, False, ("bf16-true", BF16, BF16, FP32, 10, True)),
        # LoRA: the base stays in its stored 16 bits, the adapter trains in fp32 (bf16-true too: it is tiny).
        ("bf16", "bf16", BF16, True, ("bf16-mixed", FP32, BF16, BF16, 16, False)),
        ("bf16-true", "bf16", BF16, True, ("bf16-true", FP32, BF16, BF16, 16, False)),
    ],
)
def test_the_policy_names_every_dtype(
    requested: str, compute: str, stored: torch.dtype, adapter: bool, expected: tuple[Any, ...]
) -> None:
    p = precision.policy(requested, compute, stored, adapter)
    assert (p.regime, p.trained, p.frozen, p.stored, p.trained_bytes(), p.compensated) == expected
    assert p.reduce == FP32  # sharded gradients are summed in fp32 in every regime


def test_the_stored_dtype_is_the_configs_in_either_transformers_spelling() -> None:
    assert precision.stored_dtype(SimpleNamespace(dtype="bfloat16")) == BF16
    assert precision.stored_dtype(SimpleNamespace(dtype=None, torch_dtype="float16")) == FP16
    assert precision.stored_dtype(SimpleNamespace(dtype=None)) == FP32  # says none: fp32
    assert precision.load_dtype("auto", adapter=False, stored=BF16) == FP32  # a full fine-tune loads its masters
    assert precision.load_dtype("auto", adapter=True, stored=BF16) == BF16  # an adapter's base stays bf16
