"""The small interface through which a fine-tune talks to whoever runs it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


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


class StateSavingReporter:
    """A reporter whose failed call first saves the run's resumable state, then raises.

    A call fails when the search's storage stayed away longer than its retries (or a shutdown
    cut them short). The run ends there and its retry resumes from the state saved here,
    not from the last periodic one, up to ``resume_every_minutes`` of training earlier.
    """

    def __init__(self, inner: Reporter, save_state: Callable[[], object]) -> None:
        self.inner, self.save_state = inner, save_state

    def report(self, value: float, step: int) -> None:
        self._call(self.inner.report, value, step)

    def should_prune(self) -> bool:
        return self._call(self.inner.should_prune)

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        self._call(self.inner.set_attrs, attrs)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            try:
                saved = self.save_state()
                log.warning("the search could not be told (%s); resumable state saved: %s", type(exc).__name__, saved)
            except Exception as err:  # the original error is the one to report
                log.warning("could not save the resumable state after %s: %s", type(exc).__name__, err)
            raise


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
