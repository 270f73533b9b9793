"""Attention kernels: SDPA, in fp32 on a CPU under bf16 autocast, where PyTorch's bf16 attention
kernel is 5x slower than fp32 (see docs/decisions.md, "Attention in fp32 on a CPU under bf16
autocast"). GPUs keep bf16 attention: there it is the fast path."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NAME = "hpsearch_sdpa"  # the attention implementation's registered name (transformers' AttentionInterface)


def sdpa_fp32_on_cpu(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    # Autocast would cast fp32 inputs straight back to bf16 for SDPA.
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


def use_fast_attention(model: torch.nn.Module, device: torch.device, precision: str) -> None:
    """Switch a model loaded with "sdpa" to the fp32-on-CPU variant when that is faster."""
    if device.type != "cpu" or precision != "bf16":
        return
    config: Any = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_fp32_on_cpu)
    # And SDPA's masks under the new name: transformers builds a padding mask only for an implementation its mask
    # interface knows, and hands an unknown one no mask at all, so every row would attend to its padding.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)  # type: ignore[operator]
