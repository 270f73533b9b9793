"""Choosing and applying the numeric precision a device does best."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpsearch.trainer.config import ConfigError


def resolve(requested: str, device: torch.device) -> str:
    """Turn "auto" into bf16 / fp16 / fp32 for ``device``; explicit choices are checked."""
    if requested == "fp32":
        return "fp32"
    if device.type == "cuda":
        # Only Ampere and newer do bf16 in hardware; torch's default check also says yes where
        # it is emulated (V100, T4, 2080 Ti), several times slower than fp16 there.
        bf16_ok = torch.cuda.is_bf16_supported(including_emulation=False)
        if requested == "auto":
            # fp16 needs a loss scaler and can overflow; bf16 has fp32's range, so prefer it.
            return "bf16" if bf16_ok else "fp16"
        if requested == "bf16" and not bf16_ok:
            raise ConfigError("train.precision: bf16 is not supported on this GPU; use fp16 or auto")
        return requested
    if device.type == "cpu":
        # On CPUs with AVX512-BF16/AMX, autocast to bf16 is faster than fp32; elsewhere
        # it is emulated and slower, so "auto" keeps fp32.
        bf16_ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if requested == "auto":
            return "bf16" if bf16_ok else "fp32"
        if requested == "fp16":
            raise ConfigError("train.precision: fp16 is not supported on CPU; use bf16, fp32 or auto")
        return requested
    return "fp32" if requested == "auto" else requested


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    # Only fp16 underflows small gradients; bf16 and fp32 need no scaling.
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler: Any, scaler: torch.amp.GradScaler) -> bool:
    """One update and one step of the learning-rate schedule; False when fp16's loss scaler skipped
    the update (inf/NaN gradients, as in most fp16 runs' first steps). The schedule then waits too, as
    accelerate's does, so warm-up counts real updates (and torch does not warn of a scheduler stepped first)."""
    # get_scale() syncs with the GPU once per step, only under fp16; a disabled scaler (bf16, fp32)
    # answers 1.0 without a sync and never backs off.
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scaler.get_scale() < before:
        return False
    scheduler.step()
    return True
