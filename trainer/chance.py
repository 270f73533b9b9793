"""Chance level: what a classifier that learned nothing but the label frequencies scores.

A learning rate too low to move the weights, or so high that training diverged, leaves a
model that predicts the label prior. Searches over 1e-6..1e-3 draw such rates often, and a
successive-halving pruner promotes the first trials to reach a rung for want of competitors,
so without this test a run at chance level can train to its last step.

The test needs both signs of "no signal", because each alone misleads early in a run:
validation accuracy stays at the majority rate for a while after the loss has started to
fall (a good rate just out of warm-up), and an over-confident model that does have signal
can have a loss above the prior's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hpsearch.trainer.evaluate import Metrics


@dataclass(frozen=True)
class Chance:
    loss: float
    """Entropy of the validation labels: the cross-entropy of the best constant prediction."""
    accuracy: float
    """Share of the most frequent validation label."""
    margin: float
    """One standard error of an accuracy at that rate on this many examples."""

    @classmethod
    def of(cls, labels: Sequence[int]) -> Chance | None:
        """From the validation labels; None without labels (causal LM, empty split)."""
        if not labels:
            return None
        n = len(labels)
        shares = [c / n for c in Counter(labels).values()]
        top = max(shares)
        return cls(
            loss=-sum(p * math.log(p) for p in shares),
            accuracy=top,
            margin=math.sqrt(top * (1 - top) / n),
        )

    @staticmethod
    def judged_from(warmup_steps: int, total_steps: int) -> int:
        """First step at which a run is judged: once its rate has warmed up and it has had a
        fifth of its steps, since any run is at chance at its first steps and validation may
        come every few steps of a long run."""
        return max(warmup_steps, -(-total_steps // 5))

    def matches(self, metrics: Metrics) -> bool:
        """Whether a validation point is no better than the label prior."""
        return self._accuracy_at_chance(metrics) and metrics.loss >= self.loss

    def not_yet_seen(self, metrics: Metrics) -> bool:
        """Whether the loss has left the prior's but accuracy has not: the model has begun to
        learn (at first, often just the label frequencies) and accuracy does not show it yet."""
        return self._accuracy_at_chance(metrics) and metrics.loss < self.loss

    def _accuracy_at_chance(self, metrics: Metrics) -> bool:
        """Accuracy within a standard error of the majority rate, at a finite loss."""
        if metrics.accuracy is None or not math.isfinite(metrics.loss):
            return False
        return metrics.accuracy <= self.accuracy + self.margin
