"""What a task's model computes and how its loss is summed: the only place the tasks differ in training."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpsearch.trainer.batches import CAUSAL_LM, IGNORE_INDEX


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    if task == CAUSAL_LM:
        # No key/value cache in training: it is only useful for generation and costs memory.
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    else:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    result: torch.Tensor = out.logits
    return result


def predictions_and_targets(logits: torch.Tensor, labels: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Line up what is scored with what it should be: position t of a causal LM predicts token t + 1."""
    if task == CAUSAL_LM:
        return logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return logits, labels


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over the batch's targets, in fp32.

    Summed, so the loop can divide by the targets of the whole optimizer step (every
    micro-batch and every rank): accumulated gradients then equal one big batch's, whatever
    the lengths of the micro-batches.
    """
    scores, targets = predictions_and_targets(logits, labels, task)
    return F.cross_entropy(scores.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
