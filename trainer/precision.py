"""Choosing and applying the numeric precision: the one place that says, for a trial, the dtype of each thing it
holds (stored weights, trained masters, gradients, optimizer state, compute, gradient reduction). The loader
(trainer/model.py), the loop, the checkpoint and the memory plan (trainer/memory.py) all read a :class:`Policy`.

The regimes, named as litgpt names them:
- ``bf16-mixed`` / ``fp16-mixed`` (``precision = "auto" | "bf16" | "fp16"``): fp32 master weights, fp32 gradients
  and fp32 AdamW moments; the forward and backward run under 16-bit autocast (fp16 with a loss scaler). A bf16
  checkpoint is loaded into fp32 masters too: bf16 keeps 8 bits of mantissa, so near a weight of 0.016 an AdamW
  step of 2e-5 would round away (pure bf16 training loses most small updates).
- ``fp32``: everything fp32, no autocast.
- ``bf16-true`` (opt-in): bf16 weights, gradients and moments, for a model whose fp32 masters do not fit; the update
  is Kahan-compensated (torch-optimi's AdamW) so small steps accumulate instead of rounding away.
Adapters (LoRA/QLoRA): the frozen base keeps its checkpoint's dtype (its memory is the point of adapters), the
adapter and a classifier's head train in fp32 (peft's own default: ``autocast_adapter_dtype``).
The best checkpoint is saved in the checkpoint's own dtype: a bf16 model's best folder is bf16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from hpsearch.trainer.config import ConfigError

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Policy:
    """The dtype of each thing a trial holds (torchtitan's ``MixedPrecisionPolicy``, stated whole)."""

    regime: str  # "bf16-mixed", "fp16-mixed", "fp32" or "bf16-true": what logs, the plan and docs call it
    compute: str  # what autocast runs in: "bf16", "fp16" or "fp32" (no autocast)
    trained: torch.dtype  # trained parameters (masters), their gradients and the optimizer's moments
    frozen: torch.dtype  # the frozen base of an adapter trial
    stored: torch.dtype  # the checkpoint's own dtype: the best model is saved in it
    reduce: torch.dtype = torch.float32  # gradients summed across ranks (sharded trials) in fp32: no lost bits
    compensated: bool = False  # bf16-true: the optimizer keeps a bf16 Kahan compensation per trained parameter

    def trained_bytes(self) -> int:
        """Bytes per trained parameter for its weight, gradient and optimizer state (AdamW's two moments, and
        bf16-true's compensation buffer)."""
        size = torch.finfo(self.trained).bits // 8
        return 4 * size + (size if self.compensated else 0)

    def cast_bytes(self) -> int:
        """Bytes per trained parameter autocast keeps as a 16-bit copy from the forward through the backward (its
        weight cache), in the mixed regimes; 0 where the weights are already in the compute dtype."""
        return 2 if self.compute != "fp32" and self.trained == torch.float32 else 0


def policy(requested: str, compute: str, stored: torch.dtype, adapter: bool = False) -> Policy:
    """The policy of a trial: ``requested`` is the spec's ``train.precision``, ``compute`` its resolved compute
    precision (:func:`resolve`, or the plan's guess), ``stored`` the checkpoint's dtype (:func:`stored_dtype`)."""
    stored = stored if stored in (*SIXTEEN_BIT, torch.float32) else torch.float32
    if requested == "fp32" or compute == "fp32":
        return Policy("fp32", "fp32", torch.float32, torch.float32, stored)
    if requested == "bf16-true":
        # An adapter is a few MB: it trains in fp32 even here; only the base is bf16 whatever it was stored in.
        trained = torch.float32 if adapter else torch.bfloat16
        return Policy("bf16-true", "bf16", trained, torch.bfloat16, stored, compensated=not adapter)
    # An adapter's base keeps the dtype it was stored in: a 16-bit base stays 16-bit, an fp32 one fp32.
    return Policy(f"{compute}-mixed", compute, torch.float32, stored, stored)


def load_dtype(requested: str, adapter: bool, stored: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a trial's model is loaded in before its device is known: a full fine-tune's weights are its
    masters; an adapter's base is frozen. The loop casts what the device's policy wants otherwise (an adapter on
    a CPU without bf16 computes in fp32, its base too), so this only spares a second copy in the common case."""
    chosen = policy(requested, "bf16", stored, adapter)
    return chosen.frozen if adapter else chosen.trained


def apply(model: torch.nn.Module, chosen: Policy) -> None:
    """Give ``model``'s parameters the policy's dtypes, in place: trained ones ``trained``, frozen ones ``frozen``
    (a quantized base's packed weights are not floating point and stay as they are; its other frozen layers keep
    the fp32 peft gave them). Before the optimizer is made: its moments take their parameters' dtype."""
    quantized = bool(getattr(model, "is_quantized", False))
    for param in model.parameters():
        if param.is_floating_point() and not (quantized and not param.requires_grad):
            dtype = chosen.trained if param.requires_grad else chosen.frozen
            if param.dtype != dtype:
                param.data = param.data.to(dtype)


def stored_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint says its weights are in (config.json's ``dtype``, ``torch_dtype`` before
    transformers 5); fp32 when it says none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def resolve(requested: str, device: torch.device) -> str:
    """Turn "auto" into bf16 / fp16 / fp32 for ``device`` (the compute precision); explicit choices are checked.
    ``bf16-true`` computes in bf16."""
    requested = "bf16" if requested == "bf16-true" else requested
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


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off inside an autocast region (which keeps its cache of casts: only the outermost region's end
    clears it)."""
    return torch.autocast(device_type=device.type, enabled=False)


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
