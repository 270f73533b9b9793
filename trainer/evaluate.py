"""Validation: loss, accuracy and macro F1 over a split, without gradients and with little padding."""

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
    f1: float = 0.0
    """Macro F1: the mean over labels of per-label F1, so a rare label counts as much as a
    frequent one (accuracy rewards always predicting the majority label)."""

    def objective(self, metric: str) -> float:
        return {"loss": self.loss, "accuracy": self.accuracy, "f1": self.f1}[metric]


def macro_f1(confusion: torch.Tensor) -> float:
    """Macro F1 from a confusion matrix (rows: true label, columns: prediction)."""
    confusion = confusion.double()
    tp = confusion.diag()
    predicted, actual = confusion.sum(0), confusion.sum(1)
    denom = predicted + actual
    # A label never predicted nor present has no F1; it is left out of the mean.
    present = denom > 0
    f1 = torch.where(present, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
    return float(f1[present].mean().item()) if bool(present.any()) else 0.0


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module, data: Encoded, *, pad_id: int, batch_size: int, device: torch.device, precision: str
) -> Metrics:
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion: torch.Tensor | None = None
    for indices in eval_batches(data.lengths, batch_size):
        batch = {k: v.to(device, non_blocking=True) for k, v in collate(data, indices, pad_id).items()}
        with prec.autocast(precision, device):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, batch["labels"], reduction="sum").double()
        n_labels = logits.shape[-1]
        pairs = batch["labels"] * n_labels + logits.argmax(-1)
        counts = torch.bincount(pairs, minlength=n_labels * n_labels).view(n_labels, n_labels)
        confusion = counts if confusion is None else confusion + counts
    model.train(was_training)
    n = len(data)
    if confusion is None:
        return Metrics(loss=float("nan"), accuracy=0.0, f1=0.0)
    # One host sync for the whole pass.
    confusion = confusion.cpu()
    accuracy = confusion.diag().sum().item() / n
    return Metrics(loss=loss_sum.item() / n, accuracy=accuracy, f1=macro_f1(confusion))
