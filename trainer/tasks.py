"""What a task's model computes and how its loss is summed: the only place the tasks differ in training."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpsearch.trainer.task_names import CAUSAL_LM, IGNORE_INDEX, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    # No key/value cache in training: it is only useful for generation and costs memory.
    extra: dict[str, object] = {"use_cache": False} if task == CAUSAL_LM else {}
    if "token_type_ids" in batch:  # a sentence pair: which tokens are the second sentence's
        extra["token_type_ids"] = batch["token_type_ids"]
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """The loss summed (not averaged) over the batch's targets, in fp32: the loop divides by the targets of the
    whole optimizer step (every micro-batch and rank), so accumulated gradients equal one big batch's. Each task's
    loss is the one transformers' heads compute for its problem_type, per target: cross-entropy (a class, a tag, a
    next token), squared error (regression), binary cross-entropy averaged over the labels (multi-label)."""
    logits = logits.float()
    if task == REGRESSION:
        return F.mse_loss(logits, labels.view_as(logits), reduction="sum")  # both (rows, 1)
    if task == MULTI_LABEL:
        # Mean over the labels, sum over the rows: transformers' BCEWithLogitsLoss (mean over both) x rows.
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / logits.shape[-1]
    if task == CAUSAL_LM:  # position t of a causal LM predicts token t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    if task in (CAUSAL_LM, TOKEN_CLASSIFICATION):
        logits, labels = logits.flatten(0, 1), labels.flatten()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
