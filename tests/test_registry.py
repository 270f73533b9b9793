"""The worker registry and its heartbeat, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy

from hpsearch.storage import ledger, liveness, registry
from hpsearch.storage.db import Database
from hpsearch.storage.open import Storage, open_storage


@pytest.fixture
def storage(storage_url: str) -> Iterator[Storage]:
    st = open_storage(storage_url, create=True)
    try:
        yield st
    finally:
        st.close()


def _only(db: Database, study: str) -> liveness.WorkerView:
    (w,) = liveness.list_workers(db, study)
    return w


class TestRegistryContract:
    def test_register_trial_and_end_by_database_clock(self, storage: Storage) -> None:
        db = storage.db
        before = db.now()
        wid = registry.register(db, "s", "hostA/cuda:0/1", "cuda:0", host="hostA", pid=4242)
        w = _only(db, "s")
        assert (w.host, w.device, w.pid, w.state, w.current_trial) == (
            "hostA",
            "cuda:0",
            4242,
            "live",
            None,
        )
        assert before - 1 <= w.started_at <= db.now() + 1

        registry.trial_started(db, wid, 7)
        assert _only(db, "s").current_trial == 7
        time.sleep(0.4)
        live = _only(db, "s")
        assert live.device_seconds >= 0.35, "a running trial's time counts while it runs"
        registry.trial_ended(db, wid)
        w = _only(db, "s")
        assert w.current_trial is None and w.trials_finished == 1
        assert 0.35 <= w.device_seconds < 5
        registry.end(db, wid)
        w = _only(db, "s")
        assert w.state == "finished"
        assert ledger.device_time(db, "s").seconds == pytest.approx(w.device_seconds, abs=0.05)
        assert liveness.list_workers(db, "other study") == []

    def test_silent_worker_is_lost_and_its_trial_time_stops_at_last_beat(self, storage: Storage) -> None:
        db = storage.db
        wid = registry.register(db, "s", "w", "cuda:1", heartbeat_s=0.2)
        registry.trial_started(db, wid, 0)
        time.sleep(1.0)  # more than MISSED_BEATS x 0.2 s without a beat
        w = _only(db, "s")
        assert w.state == "lost" and w.current_trial == 0
        assert w.heartbeat_age_s >= 0.9
        assert w.device_seconds < 0.3, "a lost worker's trial is counted up to its last heartbeat"
        registry.beat(db, wid)
        assert _only(db, "s").state == "live"

    def test_worker_dead_before_a_beat_in_its_trial_counts_no_negative_time(self, storage: Storage) -> None:
        # Killed right after its trial began, before its next heartbeat (which the row's clock is older than):
        # `status` printed "-0.000 h". The supervisor closes the attempt when it sees the death: a moment's time.
        db = storage.db
        wid = registry.register(db, "s", "w", "cpu:0", host="h", pid=7, heartbeat_s=60)
        time.sleep(0.3)
        registry.trial_started(db, wid, 0)
        liveness.end_dead(db, "s", host="h", pid=7)
        w = _only(db, "s")
        assert w.state == "finished" and 0.0 <= w.device_seconds < 1.0

    def test_the_ledger_sums_attempts_by_the_database_clock_and_forgets_a_deleted_study(self, storage: Storage) -> None:
        db = storage.db
        group = registry.register(db, "s", "w2", "cpu:0+1", host="h", pid=8, heartbeat_s=60)
        registry.trial_started(db, group, 0)
        time.sleep(0.3)
        assert ledger.end_trial(db, "s", 0) >= 0.6, "two devices for 0.3 s"
        closed = ledger.device_time(db, "s").seconds
        time.sleep(0.2)
        assert ledger.device_time(db, "s").seconds == closed, "a closed attempt counts no more"
        assert _only(db, "s").device_seconds == pytest.approx(closed)
        registry.forget_study(db, "s")
        assert ledger.device_time(db, "s").seconds == 0.0, "a study made anew under the name starts with no device time"

    def test_host_clock_is_never_used(self, storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        # A host whose clock is a day off must still look live: only the database clock counts.
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 86400)
        wid = registry.register(storage.db, "s", "w", "cpu:0", heartbeat_s=60)
        registry.beat(storage.db, wid)
        w = _only(storage.db, "s")
        assert w.state == "live" and w.heartbeat_age_s < 5

    def test_registration_beats_in_background_and_ends_cleanly(self, storage: Storage) -> None:
        with registry.Registration(storage.db, "s", "w", "cuda:0", interval_s=0.05) as reg:
            assert _eventually(lambda: reg.beats >= 3)
            assert _only(storage.db, "s").state == "live"
            reg.trial_started(3)
            reg.trial_ended(finished=False)
        w = _only(storage.db, "s")
        assert w.state == "finished" and w.trials_finished == 0 and w.current_trial is None

    def test_a_live_row_never_ages_past_its_interval_around_trial_starts(self, storage: Storage) -> None:
        # Read on an engine of its own: the heartbeat must not wait for the watcher's sessions.
        watcher = open_storage(storage.url, create=False)
        interval, worst = 1.0, 0.0
        try:
            with registry.Registration(storage.db, "s", "w", "cpu:0", interval_s=interval) as reg:
                for number in range(3):
                    beats = reg.beats
                    assert _eventually(lambda beats=beats: reg.beats > beats)
                    reg.trial_started(number)  # just after a beat, as a worker's next trial may start
                    deadline = time.monotonic() + 2 * interval
                    while time.monotonic() < deadline:
                        worst = max(worst, _only(watcher.db, "s").heartbeat_age_s)
                        # What a worker waiting for a retry calls stale (search/workers/worker.py).
                        assert liveness.stale_trials(watcher.db, "s", missed_beats=1.5) == [], worst
                        time.sleep(0.02)
                    reg.trial_ended()
        finally:
            watcher.close()
        assert worst < 1.4 * interval, f"a live row aged {worst:.2f}s with a {interval:g}s heartbeat"


def test_host_name_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.HOST_ENV, "instance-b")
    assert registry.this_host() == "instance-b"
    monkeypatch.setenv(registry.HOST_ENV, "")
    assert registry.this_host() == os.uname().nodename


def test_heartbeat_borrows_the_one_pooled_connection(pg_url: str) -> None:
    """While the trainer holds the process's connection, the heartbeat waits for it instead of
    opening a second one; pg_stat_activity sees one connection for the worker throughout."""
    storage = open_storage(pg_url, create=True)
    dbname = pg_url.rsplit("/", 1)[1]
    probe = sqlalchemy.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg2://"))

    def connections() -> int:
        with probe.connect() as c:
            return int(
                c.execute(
                    sqlalchemy.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND application_name = 'hpsearch'"
                    ),
                    {"d": dbname},
                ).scalar_one()
            )

    try:
        with registry.Registration(storage.db, "s", "w", "cuda:0", interval_s=0.05, quiet_wait_s=30) as reg:
            assert _eventually(lambda: reg.beats >= 1)
            # Take the connection between two beats, as a trainer's storage call would.
            assert _eventually(storage.db.pooled_connection_idle)
            peak = 0
            with storage.db.session() as s:  # the "trainer" holds the connection for 0.6 s
                s.execute(sqlalchemy.text("SELECT 1"))
                time.sleep(0.1)  # a beat that was already under way has finished by now
                beats = reg.beats
                for _ in range(5):
                    time.sleep(0.1)
                    peak = max(peak, connections())
                assert reg.beats == beats, "the heartbeat must wait for the pooled connection"
            assert _eventually(lambda: reg.beats > beats)
            peak = max(peak, connections())
        assert peak == 1
    finally:
        probe.dispose()
        storage.close()


def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_second_thread_waits_for_the_connection_but_nesting_still_works(pg_url: str) -> None:
    """The pool never gives another thread a second connection, and a thread that nests a
    session in its own (Optuna creating its tables) is not deadlocked by that rule."""
    import threading

    storage = open_storage(pg_url, create=True)
    seen: list[int] = []
    try:
        with storage.db.session() as outer:
            outer.execute(sqlalchemy.text("SELECT 1"))
            with storage.db.session() as inner:  # same thread: gets the overflow connection
                inner.execute(sqlalchemy.text("SELECT 1"))
                seen.append(storage.db.engine.pool.checkedout())
        seen.append(storage.db.engine.pool.checkedout())

        waited = threading.Event()

        def other() -> None:
            storage.db.now()  # another thread: must wait for the trainer's session to end
            waited.set()

        with storage.db.session() as trainer:
            trainer.execute(sqlalchemy.text("SELECT 1"))
            t = threading.Thread(target=other)
            t.start()
            time.sleep(0.5)
            assert not waited.is_set(), "the other thread must not open its own connection"
            seen.append(storage.db.engine.pool.checkedout())
        t.join(timeout=10)
        assert waited.is_set()
        assert seen == [2, 0, 1]
    finally:
        storage.close()
