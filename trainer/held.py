"""What a rank's tensors really hold, measured from its local shards (a sharded rank's: its part of each)."""

from __future__ import annotations

from typing import Any

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """What this rank really holds, measured from its local shards: parameters, gradients (after a step's
    backward, before zero_grad) and optimizer state."""
    params = list(model.parameters())
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    return {
        "parameters": sum(local(p).nbytes for p in params),
        "gradients": sum(local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer": sum(local(v).nbytes for v in moments),
        "trained": sum(local(p).nbytes for p in params if p.requires_grad),  # what its gradients take in a step
    }
