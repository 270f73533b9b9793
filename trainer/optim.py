"""Optimizer, learning-rate schedule and step plan of a fine-tune."""

from __future__ import annotations

import math

import torch

from hpsearch.trainer.config import TrainConfig


def plan_steps(n_examples: int, batch_size: int, epochs: int, max_steps: int) -> tuple[int, int]:
    """(total optimizer steps, optimizer steps per epoch); the last step of an epoch may be short."""
    per_epoch = max(1, math.ceil(n_examples / batch_size))
    total = per_epoch * epochs
    return (min(total, max_steps) if max_steps else total), per_epoch


def build_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, *, compensated: bool = False
) -> torch.optim.Optimizer:
    """AdamW over the trained parameters; ``compensated`` (precision bf16-true): torch-optimi's AdamW with Kahan
    summation, whose bf16 compensation buffer keeps the part of each update that bf16 weights cannot hold, so a
    step of 2e-5 on a weight of 0.016 (bf16 spacing 1.2e-4 there) is not rounded away."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Weight decay on biases and norm scales only shrinks them toward zero for no benefit.
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if compensated:
        import optimi

        # torch's AdamW defaults (optimi's own are betas (0.9, 0.99), eps 1e-6): the regimes differ in dtype only.
        return optimi.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, kahan_sum=True)
    # The fused kernel (CUDA, and CPU since torch 2.4) updates all parameters in one pass; else multi-tensor.
    # torch.__version__ is a TorchVersion: it compares as a version ("2.10" >= "2.4"), not as a string.
    fused = device.type == "cuda" or (device.type == "cpu" and torch.__version__ >= "2.4")
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=fused)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    return round(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, warmup: int, total_steps: int) -> float:
    """The share of the peak learning rate the optimizer step after ``step`` steps uses: a linear warm-up over
    ``warmup`` steps, then a linear decay to zero at ``total_steps``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total_steps))
