"""The small interface through which a fine-tune talks to whoever runs it."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpsearch.trainer.report_queue import ReportQueue

if TYPE_CHECKING:
    from hpsearch.trainer.evaluate import Metrics
    from hpsearch.trainer.stats import Figures, Speed

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """What the trainer needs from a search: Optuna's trial, reduced to a few calls that say what
    happened. Where the search records it is its own business (search/workers/trial_attrs.py)."""

    immediate: bool
    """True: called at once on the run's own thread, never through a report queue (its calls never wait)."""

    def report(self, value: float, step: int, metrics: Metrics | None = None) -> None:
        """Record the objective at optimizer step ``step``, with every metric of that point."""

    def should_prune(self) -> bool:
        """Whether the search (its pruner, or workers/early_stop.py) wants the run stopped after the last report."""

    def best_saved(self, path: Path, step: int, values: dict[str, float]) -> None:
        """A new best model (of step ``step``, with ``Metrics.values()``) is at ``path`` (absolute); also
        said on resume, of the one kept."""

    def state_saved(self, path: Path) -> None:
        """The resumable state is at ``path`` (absolute), for whoever retries the run."""

    def resumed(self, step: int) -> None:
        """The run continues from a resumable state of optimizer step ``step``."""

    def measured(self, figures: Figures) -> None:
        """What the run measured of itself (speed, precision, micro-batch size...), once, at its end."""


class StateSavingReporter:
    """The reporter a run talks to: training does not wait for the search (calls go through a
    ``ReportQueue``, or straight to a reporter whose ``immediate`` is true), and the run's resumable
    state is saved when the search cannot be reached. See docs/failures.md, "PostgreSQL restarted".

    ``should_prune`` waits only while the search keeps up (``ANSWER_S``); else the run trains on and
    is asked at its next point. A call that failed (storage away past its retries) makes the next
    call save the state and raise, so the retry resumes from here, not from the last periodic state.
    A call can also hang (silent network path, frozen server): a stop while ``flush`` waits saves the
    state at once, and the call is abandoned (``CallAbandoned``) when ``stop_waiting`` says so.
    """

    POLL_S = 0.2
    # How long a pruning question is waited for, and how far behind the search may fall before the run stops
    # asking: far above a healthy storage's milliseconds.
    ANSWER_S = 10.0

    def __init__(
        self,
        inner: Reporter,
        save_state: Callable[[], object],
        should_stop: Callable[[], bool] = lambda: False,
        stop_waiting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inner, self.save_state = inner, save_state
        self.should_stop, self.stop_waiting = should_stop, stop_waiting
        self.report_queue = ReportQueue(inline=inner.immediate)
        self._state_saved = False  # by this reporter: once per run, for a failure or a stop

    # What happened, sent on to the search in order, on the queue's thread: the run does not wait for a database.
    def report(self, value: float, step: int, metrics: Metrics | None = None) -> None:
        self._send(self.inner.report, value, step, metrics)

    def best_saved(self, path: Path, step: int, values: dict[str, float]) -> None:
        self._send(self.inner.best_saved, path, step, values)

    def state_saved(self, path: Path) -> None:
        self._send(self.inner.state_saved, path)

    def resumed(self, step: int) -> None:
        self._send(self.inner.resumed, step)

    def measured(self, figures: Figures) -> None:
        self._send(self.inner.measured, figures)

    def _send(self, call: Callable[..., None], *args: object) -> None:
        self._raise_failure()
        self.report_queue.send(call, *args)

    def settle(self) -> None:
        """Let the calls still on their way reach the search, for at most ANSWER_S, raising nothing: a run that ends
        on an error of its own is ended by the search after its last record (a best_saved landing after that end's
        clean-up would name a deleted best/). Not after a stop, or once a call failed: the search is away then."""
        last, give_up = self.report_queue.newest(), time.monotonic() + self.ANSWER_S
        while last is not None and self.report_queue.error is None and not self.should_stop():
            if last.done.wait(self.POLL_S) or time.monotonic() > give_up:
                return

    def should_prune(self) -> bool:
        self._raise_failure()
        behind = self.report_queue.oldest()
        if behind is not None and time.monotonic() - behind.sent > self.ANSWER_S:
            return False  # the search is slow or away: train on, and ask at the next point
        question = self.report_queue.send(self.inner.should_prune)
        give_up = time.monotonic() + self.ANSWER_S
        while not question.done.wait(self.POLL_S):
            if self.should_stop() or time.monotonic() > give_up:
                return False  # a late answer is dropped; the loop sees a stop at its next step
        self._raise_failure()
        return bool(question.result)

    def flush(self) -> None:
        """Wait until every call has reached the search; raise the first one's error."""
        last = self.report_queue.newest()
        while last is not None and not last.done.wait(self.POLL_S):
            if not self._state_saved and self.should_stop():
                self._save("a stop came while the search did not answer")
            if self._state_saved and self.stop_waiting():
                hung = self.report_queue.oldest() or last
                raise CallAbandoned(f"the search did not answer {hung.fn.__name__} before the stop's deadline")
        self._raise_failure()

    def _raise_failure(self) -> None:
        error = self.report_queue.error
        if error is None:
            return
        if not self._state_saved:
            self._save(f"the search could not be told ({type(error).__name__})")
        raise error

    def _save(self, why: str) -> None:
        self._state_saved = True
        try:
            log.warning("%s; resumable state saved: %s", why, self.save_state())
        except Exception as err:  # the storage's error, if any, is the one to report
            log.warning("%s; could not save the resumable state: %s", why, err)


class CallAbandoned(Exception):
    """A reporter call still hanging when a stopping run could wait no longer."""


class Status(enum.StrEnum):
    """How a run ended, as the trainer sees it (search/workers/outcome.py says what each means for the trial)."""

    COMPLETE = "complete"
    PRUNED = "pruned"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # a stop request: the resumable state is saved


class FailReason(enum.StrEnum):
    """Why a trial ended other than complete or pruned by its pruner, each reason named once: its value is what the
    trial's ``fail_reason`` attribute holds (a detail may follow in brackets), ``text`` what `status` says of it."""

    text: str

    def __new__(cls, value: str, text: str) -> FailReason:
        member = str.__new__(cls, value)
        member._value_, member.text = value, text
        return member

    OOM = "oom", "out of memory even at micro-batch 1"
    NAN_LOSS = "nan_loss", "NaN loss"
    AT_CHANCE = "at_chance", "at chance"
    NO_VALIDATION_POINT = "no_validation_point", "no validation point reached"
    DISK_FULL = "disk_full", "disk full"
    CHECKPOINT_ERROR = "checkpoint_error", "a checkpoint could not be saved"
    TRIAL_DIR_REFUSED = "trial_dir_refused", "its folder was refused"
    BAD_PARAMS = "bad_params", "parameters no trial of the spec can take"
    CONFIG_ERROR = "config_error", "configuration error"
    ERROR = "error", "error (the trial's train.log says which)"
    INTERRUPTED = "interrupted", "stopped; handed back to resume"
    STORAGE_ERROR = "storage_error", "the storage failed; handed back"
    WORKER_CRASH = "worker_crash", "its worker crashed; handed back"
    WORKER_LOST = "worker_lost", "its worker was lost; handed back"
    OOM_RESTART = "oom_restart", "a rank ran out of memory; retried with a smaller micro-batch"
    NOT_STARTED = "not_started", "could not be registered; handed back"

    def record(self, detail: str | None = None) -> str:
        """The ``fail_reason`` attribute: the value, then the detail in brackets. A bad parameter or configuration
        is recorded as its error's own line, which says only what the spec and the trial's parameters hold."""
        if not detail:
            return self.value
        return detail if self in (FailReason.BAD_PARAMS, FailReason.CONFIG_ERROR) else f"{self.value} ({detail})"

    @classmethod
    def of(cls, recorded: str | None) -> FailReason | None:
        """The reason a ``fail_reason`` attribute names, if it names one (a bare value, or one with a detail)."""
        code = (recorded or "").split(" (", 1)[0]
        return next((reason for reason in cls if reason.value == code), None)


@dataclass
class TrainResult:
    status: Status
    best_value: float | None = None
    best_step: int | None = None
    steps: int = 0
    fail_reason: FailReason | None = None
    figures: Figures | None = None

    @property
    def attrs(self) -> dict[str, Any]:
        return measured(self.figures) if self.figures else {}


def measured(figures: Figures | Speed) -> dict[str, Any]:
    """Every figure by its field name (``speed``'s flattened in), without those not measured (None)."""
    out: dict[str, Any] = {}
    for f in fields(figures):
        value = getattr(figures, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            out.update(measured(value))
        elif value is not None:
            out[f.name] = value
    return out
