"""When a run may be stopped early: by its own chance test, or by the search's pruner.

A pruner compares a run's validation points with other runs'. Early in a short fine-tune two
kinds of point say little about the run's hyperparameters, and a pruner that judges them stops
good learning rates for noise (both seen in benchmarks/search_vs_hf.py):

- a point inside the run's learning-rate warm-up: the rate has not reached its value yet, and
  the curve sits at the majority label's share;
- with an accuracy or F1 objective, a point where the loss has left the prior's but accuracy
  has not: the model has learnt the label frequencies and predicts the majority label, while
  an untrained random head can score a few points above that by luck.

A patient judge asks the pruner about neither: not before the warm-up has ended, and not about
the second kind before the step a run at chance is first judged at (warm-up and a fifth of its
steps, see Chance.judged_from). Reports still go to the search at every point.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpsearch.trainer.chance import Chance
from hpsearch.trainer.evaluate import Metrics


@dataclass
class Judge:
    chance: Chance | None
    """Of the validation labels; None for a causal LM (no chance test, no accuracy)."""
    warmup: int
    total_steps: int
    metric: str
    stop_at_chance: int = 0
    """Stop after this many judged points in a row at chance (0 = never)."""
    patient: bool = False
    """Ask the pruner only about points that say something of the hyperparameters."""
    at_chance: int = 0

    @property
    def judged_from(self) -> int:
        return Chance.judged_from(self.warmup, self.total_steps)

    def see(self, step: int, metrics: Metrics) -> None:
        """Count the points in a row, from judged_from on, that were no better than chance."""
        chance = self.chance
        matches = chance is not None and step >= self.judged_from and chance.matches(metrics)
        self.at_chance = self.at_chance + 1 if matches else 0

    @property
    def stuck(self) -> bool:
        return 0 < self.stop_at_chance <= self.at_chance

    def may_prune(self, step: int, metrics: Metrics) -> bool:
        """Whether the pruner may be asked about this point."""
        if not self.patient:
            return True
        if step < self.warmup:
            return False
        unseen = self.metric != "loss" and self.chance is not None and self.chance.not_yet_seen(metrics)
        return not (unseen and step < self.judged_from)
