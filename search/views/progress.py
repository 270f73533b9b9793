"""Live progress of `hpsearch start` / `hpsearch worker` (docs/watching.md, "In the terminal"): status lines kept
at the bottom of a terminal (live_display.py), else a log line when the numbers change and every few minutes. A
background thread reads the study, so a slow database never stalls the supervisor, and keeps the study note
(note.py) up to date as trials finish."""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState
from sqlalchemy.pool import NullPool

from hpsearch.search.study import budget, objectives, warm_start
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.views import note, status_text, summary
from hpsearch.search.workers import stop_signals
from hpsearch.storage import ledger, urls
from hpsearch.storage.db import Database, engine_kwargs

log = logging.getLogger(__name__)
POLL_S = 15.0
"""Seconds between reads of the study when nothing happened locally."""
HEARTBEAT_S = 300.0
"""Plain mode: a progress line at least this often, even when nothing changed."""


@dataclass
class Snapshot:
    """The study's state at one read, across every host."""

    n_trials: int
    metric: str
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    """Failed for good (summary.failed): failures that were handed back for a retry are not counted."""
    running: int = 0
    best_value: float | None = None
    best_number: int | None = None
    used: ledger.DeviceTime = field(default_factory=ledger.DeviceTime)
    mean_trial_s: float | None = None
    running_elapsed: list[float] = field(default_factory=list)
    finished_numbers: tuple[int, ...] = ()

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    def time_left_s(self) -> float | None:
        """Remaining trials x mean trial time, spread over the trials running now."""
        if self.mean_trial_s is None:
            return None
        mean = self.mean_trial_s
        not_started = max(0, self.n_trials - self.finished - self.failed - self.running)
        work = not_started * mean + sum(max(mean - e, 0.0) for e in self.running_elapsed)
        return work / max(1, self.running)

    def key(self) -> tuple[Any, ...]:
        return (self.finished_numbers, self.running, self.best_number, self.n_trials)


def read(study: optuna.Study, spec: StudySpec, used: ledger.DeviceTime, now: dt.datetime | None = None) -> Snapshot:
    """``used``: the study's device time, from the ledger (storage/ledger.py ``device_time``)."""
    now = now or dt.datetime.now()
    trials = warm_start.ran_here(study.get_trials(deepcopy=False))
    best = summary.best_trial(study)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    running = [t for t in trials if t.state == TrialState.RUNNING]
    return Snapshot(
        n_trials=budget.n_trials(study, spec),
        metric=spec.search.quality,
        complete=sum(t.state == TrialState.COMPLETE for t in trials),
        pruned=sum(t.state == TrialState.PRUNED for t in trials),
        failed=len(summary.failed(trials)),
        running=len(running),
        best_value=objectives.quality(best) if best else None,
        best_number=best.number if best else None,
        used=used,
        mean_trial_s=sum(_wall(t, now) for t in done) / len(done) if done else None,
        running_elapsed=[_wall(t, now) for t in running],
        finished_numbers=note.finished_key(trials),
    )


def _wall(t: optuna.trial.FrozenTrial, now: dt.datetime) -> float:
    """How long a trial ran (runs) by the clock of the host that started it: for a time-left estimate only."""
    if t.datetime_start is None:
        return 0.0
    return max(0.0, ((t.datetime_complete or now) - t.datetime_start).total_seconds())


class Poller(threading.Thread):
    """Reads the study in the background; rewrites the study note when a trial finished."""

    def __init__(self, study_name: str, storage_url: str, spec: StudySpec) -> None:
        super().__init__(name="hpsearch-progress", daemon=True)
        self.study_name, self.storage_url, self.spec = study_name, storage_url, spec
        self.latest: Snapshot | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._opened: tuple[optuna.Study, Database] | None = None
        self._noted: tuple[int, ...] | None = None
        self._failing = False

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stopping.is_set():
            self.refresh()
            self._wake.wait(POLL_S)
            self._wake.clear()

    def refresh(self) -> None:
        try:
            study, db = self._open()
            snap = read(study, self.spec, ledger.device_time(db, self.study_name))
            if snap.finished_numbers != self._noted:
                note.update(study, self.spec, snap.n_trials, snap.used)
                self._noted = snap.finished_numbers
        except Exception as exc:
            # Progress is a view: a database hiccup must never stop the search it shows.
            if not self._failing:
                log.warning(
                    "progress: cannot read study %s (%s); will retry", self.study_name, stop_signals.describe(exc)
                )
            self._failing = True
            return
        self._failing = False
        self.latest = snap

    def _open(self) -> tuple[optuna.Study, Database]:
        if self._opened is None:
            url = urls.normalize(self.storage_url)
            kwargs = {
                k: v for k, v in engine_kwargs(url).items() if k not in ("pool_size", "max_overflow", "pool_recycle")
            }
            # No pooled connection between reads: not one held for hours (a shared server's connection limit).
            rdb = optuna.storages.RDBStorage(
                url, engine_kwargs={**kwargs, "poolclass": NullPool}, skip_table_creation=True
            )
            self._opened = optuna.load_study(study_name=self.study_name, storage=rdb), Database(rdb.engine)
        return self._opened


class Progress:
    """Plain log lines; the base of the live display. The Supervisor calls start, tick and stop."""

    def __init__(self, study_name: str, storage_url: str, spec: StudySpec) -> None:
        self.study_name = study_name
        self.poller = Poller(study_name, storage_url, spec)  # the supervisor's spec: the one its workers run
        self.started = time.monotonic()
        self._trials: dict[str, tuple[int | None, float]] = {}  # device label -> (trial number, since)
        self._logged_key: tuple[Any, ...] | None = None
        self._logged_at = 0.0

    def start(self) -> None:
        self.poller.start()

    def stop(self, *, storage_lost: bool = False) -> None:
        """``storage_lost``: wait for no read in flight, try no last one (each could take a connect timeout)."""
        self.poller.stop()
        self.poller.join(timeout=0.5 if storage_lost else 5)
        # One last read, so the final line and the study note include the last trial.
        if not storage_lost and not self.poller.is_alive():
            self.poller.refresh()
        self.finish()

    @contextmanager
    def capture_output(self) -> Iterator[None]:
        """Around a child's start(): where its stdout/stderr go (here: unchanged)."""
        yield

    def tick(self, children: Iterable[Any]) -> None:
        """Called by the supervisor's loop about once a second with its children."""
        now = time.monotonic()
        changed = False
        for child in children:
            number = child.trial[1] if child.trial else None
            if self._trials.get(child.device.label, (None, 0.0))[0] != number:
                self._trials[child.device.label] = (number, now)
                changed = True
        if changed:
            self.poller.wake()  # a trial started or ended here: read the study now
        self.render()

    def render(self) -> None:
        snap = self.poller.latest
        if snap is None:
            return
        now = time.monotonic()
        if snap.key() != self._logged_key or now - self._logged_at >= HEARTBEAT_S:
            self._logged_key, self._logged_at = snap.key(), now
            log.info("progress: %s", self.line(snap))

    def finish(self) -> None:
        self.render()

    def line(self, s: Snapshot) -> str:
        best = (
            f"best {s.metric} {s.best_value:.4f} (trial {s.best_number})" if s.best_value is not None else "no best yet"
        )
        return (
            f"{s.finished}/{s.n_trials} trials finished, {s.running} running, {s.pruned} pruned, "
            f"{s.failed} failed, {best}, {s.used.text()} used, "
            f"{status_text.duration(time.monotonic() - self.started)} elapsed, {_left(s)}"
        )

    def devices_line(self) -> str:
        now = time.monotonic()
        return "  ".join(
            f"{label}: trial {number} ({status_text.duration(now - since)})" if number is not None else f"{label}: idle"
            for label, (number, since) in sorted(self._trials.items())
        )


def for_terminal(study_name: str, storage_url: str, spec: StudySpec) -> Progress:
    """A live display when stderr is a terminal, plain log lines otherwise."""
    terminal = False
    with suppress(AttributeError, ValueError):
        terminal = sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb"
    if terminal:
        from hpsearch.search.views.live_display import LiveProgress

        return LiveProgress(study_name, storage_url, spec, sys.stderr)
    return Progress(study_name, storage_url, spec)


def _left(s: Snapshot) -> str:
    if s.finished + s.failed >= s.n_trials and not s.running:
        return "done"
    left = s.time_left_s()
    return f"~{status_text.duration(left)} left" if left is not None else "time left: after the first trial"
