"""Validation: loss and accuracy / macro F1 (classification) or perplexity (causal LM), without
gradients and with little padding, sharded over data-parallel ranks."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from hpsearch.trainer import precision as prec, tasks
from hpsearch.trainer.batching import CAUSAL_LM, Encoded, collate, eval_batches
from hpsearch.trainer.distributed import World
from hpsearch.trainer.sharding import is_sharded


@dataclass(frozen=True)
class Metrics:
    loss: float  # mean cross-entropy per example (classification) or per predicted token (causal LM)
    accuracy: float | None = None
    # Macro F1: the mean of per-label F1, so a rare label counts as much as a frequent one
    # (accuracy rewards always predicting the majority label).
    f1: float | None = None
    perplexity: float | None = None  # causal LM: exp(loss)

    def objective(self, metric: str) -> float:
        return self.values()[metric]

    def values(self) -> dict[str, float]:
        """The metrics this task has, by name: loss, accuracy, f1 or loss, perplexity."""
        named = {"loss": self.loss, "accuracy": self.accuracy, "f1": self.f1, "perplexity": self.perplexity}
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


@dataclass(frozen=True)
class EarlyPoints:
    """Validation points the search asks for before a trial's first ``eval_every`` point, where its pruner can cut a
    hopeless trial at a small part of its cost. Each is scored on the same seeded subset of ``rows`` validation rows
    in every trial (all of them when ``rows`` is 0 or not fewer), reported and judged, never saved from: a trial's
    value and its kept checkpoint come from full points only (docs/search.md, "Early pruning points")."""

    steps: frozenset[int] = frozenset()
    rows: int = 0
    seed: int = 0

    def data(self, validation: Encoded) -> Encoded:
        """The rows an early point scores: a fixed draw, so every trial (and every rank) is judged on the same."""
        if not 0 < self.rows < len(validation):
            return validation
        return validation.subset(sorted(random.Random(self.seed).sample(range(len(validation)), self.rows)))


def point_at(step: int, total_steps: int, eval_every: int, early: EarlyPoints) -> Literal["full", "early"] | None:
    """What the loop does after optimizer step ``step`` (1 = the first) of ``total_steps``: a full validation point
    every ``eval_every`` steps and at the last step, so a run shorter than ``eval_every`` still has one; an early
    point at the search's early steps that are not full ones; else nothing. The one rule of where points go."""
    if step % eval_every == 0 or step == total_steps:
        return "full"
    return "early" if step in early.steps else None


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
    model: torch.nn.Module,
    data: Encoded,
    *,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    precision: str,
    num_labels: int = 0,
    world: World | None = None,
) -> Metrics:
    """Metrics over the whole split; each data-parallel rank scores every n-th batch and the
    sums are added up, so every rank returns the same figures."""
    world = world or World()
    was_training = model.training
    model.eval()
    # One vector of sums (loss, targets, then the confusion matrix): one all-reduce for all.
    sums = torch.zeros(2 + num_labels * num_labels, device=device, dtype=torch.float64)
    batches = eval_batches(data.lengths, batch_size)
    mine = batches[world.rank :: world.size]
    # A sharded model's forward gathers each block from every rank: all ranks must run as many passes, and one
    # short of a batch runs a spare pass whose result it drops.
    passes = -(-len(batches) // world.size) if is_sharded(model) else len(mine)
    for i in range(passes):
        indices = mine[i] if i < len(mine) else batches[0]
        batch = {k: v.to(device, non_blocking=True) for k, v in collate(data, indices, pad_id).items()}
        with prec.autocast(precision, device):
            logits = tasks.logits(model, batch, data.task)
        if i >= len(mine):
            continue
        sums[0] += tasks.loss_sum(logits, batch["labels"], data.task).double()
        sums[1] += data.targets(indices)
        if data.task != CAUSAL_LM:
            pairs = batch["labels"] * num_labels + logits.argmax(-1)
            sums[2:] += torch.bincount(pairs, minlength=num_labels * num_labels).double()
    model.train(was_training)
    world.all_sum(sums)
    sums = sums.cpu()  # one host sync for the whole pass
    if sums[1] == 0:
        return Metrics(loss=float("nan"))
    loss = sums[0].item() / sums[1].item()
    if data.task == CAUSAL_LM:
        return Metrics(loss=loss, perplexity=math.exp(min(loss, 700.0)))  # exp overflows past ~709
    confusion = sums[2:].view(num_labels, num_labels)
    accuracy = confusion.diag().sum().item() / len(data)
    return Metrics(loss=loss, accuracy=accuracy, f1=macro_f1(confusion))
