"""Validation: loss and each task's metrics (trainer/config.py TASK_METRICS; how each is computed: docs/tasks.md),
without gradients and with little padding, sharded over data-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hpsearch.trainer import entities, packing, precision as prec, tasks
from hpsearch.trainer.batching import collate, eval_batches
from hpsearch.trainer.distributed import World
from hpsearch.trainer.sharding import is_sharded
from hpsearch.trainer.task_names import (
    CAUSAL_LM,
    CLASSIFICATION,
    IGNORE_INDEX,
    MULTI_LABEL,
    REGRESSION,
    TOKEN_CLASSIFICATION,
)
from hpsearch.trainer.tokenised import Encoded

MULTI_LABEL_THRESHOLD = 0.5
"""multi-label: a label is predicted where its sigmoid is above this (its logit above 0)."""


@dataclass(frozen=True)
class Metrics:
    loss: float
    """Mean cross-entropy per example (classification), per tagged word (token-classification) or per predicted
    token (causal LM); mean squared error (regression); binary cross-entropy per label and example (multi-label)."""
    accuracy: float | None = None
    """Share of examples right (classification), of rows with every label right (multi-label: exact match), of
    tagged words right (token-classification)."""
    f1: float | None = None
    """classification: macro F1, the mean of per-label F1, so a rare label counts as much as a frequent one
    (accuracy rewards always predicting the majority label). multi-label: micro F1 over every (row, label).
    token-classification: entity-level micro F1, as seqeval computes it."""
    perplexity: float | None = None  # causal LM: exp(loss)
    pearson: float | None = None  # regression: Pearson's r of predictions and labels
    spearman: float | None = None  # regression: Spearman's rho (Pearson's r of their ranks, ties averaged)
    macro_f1: float | None = None  # multi-label: the mean of the labels' F1
    precision: float | None = None  # token-classification: share of predicted entities that are right
    recall: float | None = None  # token-classification: share of true entities found

    def objective(self, metric: str) -> float:
        return self.values()[metric]

    def values(self) -> dict[str, float]:
        """The metrics this task has, by name (trainer/config.py TASK_METRICS)."""
        named = {
            "loss": self.loss,
            "accuracy": self.accuracy,
            "f1": self.f1,
            "perplexity": self.perplexity,
            "pearson": self.pearson,
            "spearman": self.spearman,
            "macro_f1": self.macro_f1,
            "precision": self.precision,
            "recall": self.recall,
        }
        return {k: v for k, v in named.items() if v is not None}


class Point(NamedTuple):
    """A validation point: the objective's value, the loss and the optimizer step."""

    value: float
    loss: float
    step: int

    def beats(self, other: Point | None, metric: str) -> bool:
        """Whether this point ranks above ``other``: a better objective or, at an equal one, a lower loss
        (see docs/decisions.md, "A tie goes to the lower validation loss"; storage/retention.py ranks alike)."""
        if other is None:
            return True
        if self.value != other.value:
            return self.value < other.value if metric == "loss" else self.value > other.value
        return self.loss < other.loss


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's r; 0 where either side is constant (scipy's is undefined there: a constant says nothing)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / norm) if float(norm) > 0 else 0.0


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rho: Pearson's r of the ranks, tied values sharing their mean rank (scipy.stats.spearmanr)."""
    return pearson(_ranks(x), _ranks(y))


def _ranks(x: torch.Tensor) -> torch.Tensor:
    _, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # the last rank (from 1) of each distinct value
    return (ends - (counts.double() - 1) / 2)[inverse]


def label_f1(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor) -> tuple[float, float]:
    """Micro and macro F1 of per-label counts; a label neither present nor predicted is left out of the macro
    mean, as in :func:`macro_f1`."""
    tp, fp, fn = tp.double(), fp.double(), fn.double()
    denom = 2 * tp + fp + fn
    micro = float(2 * tp.sum() / denom.sum()) if float(denom.sum()) > 0 else 0.0
    present = denom > 0
    per_label = 2 * tp / denom.clamp(min=1)
    return micro, float(per_label[present].mean()) if bool(present.any()) else 0.0


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


def _width(data: Encoded, num_labels: int) -> int:
    """How many sums a task's validation adds up, after the loss and its targets (one all-reduce for all)."""
    return {
        CLASSIFICATION: num_labels * num_labels,  # the confusion matrix
        REGRESSION: len(data),  # each row's prediction, at its index (one rank's rows are 0 on the others)
        MULTI_LABEL: 3 * num_labels + 1,  # true positives, false positives, false negatives a label; exact matches
        TOKEN_CLASSIFICATION: 5,  # entities right, predicted, true; tagged words right, tagged words
    }.get(data.task, 0)


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    data: Encoded,
    *,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    precision: str,
    num_labels: int = 0,
    tags: Sequence[str] = (),
    world: World | None = None,
) -> Metrics:
    """Metrics over the whole split; each data-parallel rank scores every n-th batch and the
    sums are added up, so every rank returns the same figures. ``tags``: a tagger's tag names, by id."""
    world = world or World()
    was_training = model.training
    model.eval()
    num_labels = num_labels or len(tags)
    sums = torch.zeros(2 + _width(data, num_labels), device=device, dtype=torch.float64)
    batches = eval_batches(data.lengths, batch_size)
    mine = batches[world.rank :: world.size]
    # A sharded model's forward gathers each block from every rank: all ranks must run as many passes, and one
    # short of a batch runs a spare pass whose result it drops.
    passes = -(-len(batches) // world.size) if is_sharded(model) else len(mine)
    # A tagger's entities are read a row at a time (_tally): its rows are not packed here.
    packed = data.task != TOKEN_CLASSIFICATION and packing.packs(model, data.task, device)
    for i in range(passes):
        indices = mine[i] if i < len(mine) else batches[0]
        if packed:  # CPU tensors, where the model is (packing is for CPUs)
            batch = packing.collate(data, packing.bins(data.lengths, indices, data.longest), pad_id)
            indices = batch["rows"]  # the order of the logits
        else:
            batch = {k: v.to(device, non_blocking=True) for k, v in collate(data, indices, pad_id).items()}
        with prec.autocast(precision, device):
            logits = packing.logits(model, batch, data.task) if packed else tasks.logits(model, batch, data.task)
        if i >= len(mine):
            continue
        sums[0] += tasks.loss_sum(logits, batch["labels"], data.task).double()
        sums[1] += data.targets(indices)
        _tally(sums[2:], logits, batch["labels"], indices, data.task, num_labels, tags)
    model.train(was_training)
    world.all_sum(sums)
    sums = sums.cpu()  # one host sync for the whole pass
    if sums[1] == 0:
        return Metrics(loss=float("nan"))
    return _metrics(sums[0].item() / sums[1].item(), sums[2:], data, num_labels)


def _tally(
    sums: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    indices: Sequence[int],
    task: str,
    num_labels: int,
    tags: Sequence[str],
) -> None:
    """Add one batch's counts (or predictions) to ``sums``, as ``_width`` lays them out."""
    if task == CLASSIFICATION:
        pairs = labels * num_labels + logits.argmax(-1)
        sums += torch.bincount(pairs, minlength=num_labels * num_labels).double()
    elif task == REGRESSION:
        sums[torch.tensor(indices, device=sums.device)] = logits.squeeze(-1).double()
    elif task == MULTI_LABEL:
        predicted, true = logits > 0, labels > 0.5  # sigmoid(logit) > MULTI_LABEL_THRESHOLD
        k = num_labels
        sums[:k] += (predicted & true).sum(0).double()
        sums[k : 2 * k] += (predicted & ~true).sum(0).double()
        sums[2 * k : 3 * k] += (~predicted & true).sum(0).double()
        sums[3 * k] += (predicted == true).all(-1).sum().double()
    elif task == TOKEN_CLASSIFICATION:
        predicted, tagged = logits.argmax(-1), labels != IGNORE_INDEX
        sums[3] += ((predicted == labels) & tagged).sum().double()
        sums[4] += tagged.sum().double()
        # Entities are spans of tags: read on the host, a row's tagged words at a time (entities.py: seqeval's).
        for truth, guess in zip(labels.cpu().tolist(), predicted.cpu().tolist(), strict=True):
            words = [(tags[t], tags[g]) for t, g in zip(truth, guess, strict=True) if t != IGNORE_INDEX]
            right, found, present = entities.counts([t for t, _ in words], [g for _, g in words])
            sums[0] += right
            sums[1] += found
            sums[2] += present


def _metrics(loss: float, sums: torch.Tensor, data: Encoded, num_labels: int) -> Metrics:
    if data.task == CAUSAL_LM:
        return Metrics(loss=loss, perplexity=math.exp(min(loss, 700.0)))  # exp overflows past ~709
    if data.task == REGRESSION:
        predicted, true = sums, torch.tensor([row[0] for row in data.scores], dtype=torch.float64)
        return Metrics(loss=loss, pearson=pearson(predicted, true), spearman=spearman(predicted, true))
    if data.task == MULTI_LABEL:
        k = num_labels
        micro, macro = label_f1(sums[:k], sums[k : 2 * k], sums[2 * k : 3 * k])
        return Metrics(loss=loss, f1=micro, macro_f1=macro, accuracy=sums[3 * k].item() / len(data))
    if data.task == TOKEN_CLASSIFICATION:
        right, found, present, correct, tagged = (float(v) for v in sums)
        precision, recall = right / found if found else 0.0, right / present if present else 0.0
        f1 = 2 * right / (found + present) if found + present else 0.0
        return Metrics(loss=loss, f1=f1, precision=precision, recall=recall, accuracy=correct / tagged)
    confusion = sums.view(num_labels, num_labels)
    accuracy = confusion.diag().sum().item() / len(data)
    return Metrics(loss=loss, accuracy=accuracy, f1=macro_f1(confusion))
