"""Validation: loss and accuracy over a split, without gradients and with little padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpsearch.trainer import precision as prec
from hpsearch.trainer.data import Encoded, collate, eval_batches


@dataclass(frozen=True)
class Metrics:
    loss: float
    accuracy: float

    def objective(self, metric: str) -> float:
        return self.loss if metric == "loss" else self.accuracy


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module, data: Encoded, *, pad_id: int, batch_size: int, device: torch.device, precision: str
) -> Metrics:
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.long)
    for indices in eval_batches(data.lengths, batch_size):
        batch = {k: v.to(device, non_blocking=True) for k, v in collate(data, indices, pad_id).items()}
        with prec.autocast(precision, device):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, batch["labels"], reduction="sum").double()
        correct += (logits.argmax(-1) == batch["labels"]).sum()
    model.train(was_training)
    n = len(data)
    # One host sync for the whole pass.
    return Metrics(loss=loss_sum.item() / n, accuracy=correct.item() / n)
