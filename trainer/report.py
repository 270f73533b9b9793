"""The small interface through which a fine-tune talks to whoever runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


class Reporter(Protocol):
    """What the trainer needs from a search: Optuna's trial, reduced to three calls."""

    def report(self, value: float, step: int) -> None:
        """Record the objective at optimizer step ``step``."""

    def should_prune(self) -> bool:
        """Whether the search wants this run stopped after the last report."""

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        """Attach facts (checkpoint path, throughput, ...) to the run."""


class NullReporter:
    """Runs a fine-tune outside any search: records values, never prunes."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}
        self.attrs: dict[str, Any] = {}

    def report(self, value: float, step: int) -> None:
        self.values[step] = value

    def should_prune(self) -> bool:
        return False

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        self.attrs.update(attrs)


RESUME_CHECKPOINT_ATTR = "resume_checkpoint"
"""The attribute holding the path of a run's latest resumable state, for whoever retries it."""

Status = Literal["complete", "pruned", "failed", "interrupted"]


@dataclass
class TrainResult:
    status: Status
    best_value: float | None = None
    best_step: int | None = None
    best_checkpoint: str | None = None
    steps: int = 0
    fail_reason: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
