"""Dropout on a CPU: the same distribution as torch's, from cheaper random numbers."""

from __future__ import annotations

import torch


class MaskDropout(torch.nn.Module):
    """Inverted dropout whose mask on a CPU comes from 16-bit random integers: torch's CPU ``bernoulli_`` draws
    32 bits per element, and peft's mask per adapted layer was 18% of a LoRA step on a CPU (docs/adapters.md,
    "Speed"). One 64-bit draw serves four elements: the same distribution (p resolved to 1/65536, survivors
    scaled by 1/(1-p)) for 2-3x less work. CUDA's fused dropout kernel is already cheap, and stays."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self._given = p  # CUDA's kernel takes p as given: nothing there is resolved to 1/65536
        dropped = round(p * 65536)
        self.p = dropped / 65536
        self._threshold = dropped - 32768  # an int16 below it is dropped
        self._scale = 1.0 / (1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return torch.nn.functional.dropout(x, self._given, training=True)
        n = x.numel()
        words = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)
        keep = words.view(torch.int16)[:n].view(x.shape) >= self._threshold
        if x.dtype != torch.float32:  # a 16-bit mask would round 1/(1-p): scale x, not the mask
            return x * keep * self._scale
        return x * (keep.to(x.dtype) * self._scale)

    def extra_repr(self) -> str:
        return f"p={self.p:g}"


def use_mask_dropout(model: torch.nn.Module, device: torch.device) -> int:
    """Every ``nn.Dropout`` of ``model`` -> MaskDropout of the same p, on a CPU (elsewhere a no-op); how many. A
    MiniLM step of 32 short rows spends 8% of its forward and backward in ``bernoulli_`` (14 dropouts a pass);
    MaskDropout's masks cost less than half that (benchmarks/history.md, "A step's fixed costs"). Dropout holds no
    weights: checkpoints and the saved model are unchanged."""
    if device.type != "cpu":
        return 0
    swaps = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Dropout and m.p > 0]
    for name, drop in swaps:
        parent, _, attr = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        # setattr replaces a child by name in a ModuleDict, ModuleList or Sequential too (their _modules).
        setattr(holder, attr, MaskDropout(drop.p))
    return len(swaps)
