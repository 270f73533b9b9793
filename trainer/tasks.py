"""What a task's model computes and how its loss is summed: the only place the tasks differ in training."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpsearch.trainer.batching import CAUSAL_LM, IGNORE_INDEX


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    # No key/value cache in training: it is only useful for generation and costs memory.
    extra = {"use_cache": False} if task == CAUSAL_LM else {}
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over the batch's targets, in fp32: the loop divides by the targets
    of the whole optimizer step (every micro-batch and rank), so accumulated gradients equal one big batch's."""
    if task == CAUSAL_LM:  # position t of a causal LM predicts token t + 1
        logits, labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
