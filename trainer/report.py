"""The small interface through which a fine-tune talks to whoever runs it."""

from __future__ import annotations

import logging
import threading
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
    """A reporter that saves the run's resumable state when the search cannot be reached.

    A call fails when the search's storage stayed away longer than its retries (or a shutdown
    cut them short): the state is saved, then the error raised. The run ends there and its
    retry resumes from the state saved here, not from the last periodic one, up to
    ``resume_every_minutes`` of training earlier.

    A call can also hang: on a network path that went silent until the connection is declared
    dead, on a frozen server for ever (its kernel still acknowledges). It runs on a helper
    thread, so that a stop arriving meanwhile is seen at once (signal handlers run only in
    the main thread, and only between Python operations): the state is saved right away, and
    the call is waited for until ``stop_waiting`` says so, then abandoned (``CallAbandoned``).
    """

    POLL_S = 0.2

    def __init__(
        self,
        inner: Reporter,
        save_state: Callable[[], object],
        should_stop: Callable[[], bool] = lambda: False,
        stop_waiting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inner, self.save_state = inner, save_state
        self.should_stop, self.stop_waiting = should_stop, stop_waiting

    def report(self, value: float, step: int) -> None:
        self._call(self.inner.report, value, step)

    def should_prune(self) -> bool:
        return self._call(self.inner.should_prune)

    def set_attrs(self, attrs: dict[str, Any]) -> None:
        self._call(self.inner.set_attrs, attrs)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        call = _Call(fn, args)
        saved = False
        while not call.done.wait(self.POLL_S):
            if not saved and self.should_stop():
                self._save("a stop came while the search did not answer")
                saved = True
            if saved and self.stop_waiting():
                raise CallAbandoned(f"the search did not answer {fn.__name__} before the stop's deadline")
        if call.error is None:
            return call.result
        if not saved:
            self._save(f"the search could not be told ({type(call.error).__name__})")
        raise call.error

    def _save(self, why: str) -> None:
        try:
            log.warning("%s; resumable state saved: %s", why, self.save_state())
        except Exception as err:  # the storage's error, if any, is the one to report
            log.warning("%s; could not save the resumable state: %s", why, err)


class CallAbandoned(Exception):
    """A reporter call still hanging when a stopping run could wait no longer."""


class _Call:
    """``fn(*args)`` on a daemon thread; ``done`` is set once it has returned or raised."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._fn, self._args = fn, args
        threading.Thread(target=self._run, name="hpsearch-report", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn(*self._args)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


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
