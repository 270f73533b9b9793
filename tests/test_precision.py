"""precision = "auto" picks what the device runs fastest, and refuses what it cannot run."""

from __future__ import annotations

from types import SimpleNamespace

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
