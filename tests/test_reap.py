"""The reaper on both storage backends: which trials it fails and retries, and which it leaves alone.

The end-to-end cases (a whole host killed, `hpsearch reap`, a worker on another host taking
over) run real processes in test_faults.py; here the registry rows are written directly so
each rule is checked on its own, on SQLite and the real PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search.study import studies
from hpsearch.search.study.spec import load_file
from hpsearch.search.workers import reap, retry
from hpsearch.storage import attrs, liveness, registry, slots
from hpsearch.storage.open import open_storage
from hpsearch.trainer.report import FailReason


def _running_trial(storage, study: optuna.Study, worker: str) -> int:  # type: ignore[no-untyped-def]
    """What a worker does before training: claim a trial slot, ask, bind."""
    slot = slots.claim_slot(storage.db, study.study_name, 10, worker)
    assert slot is not None
    trial = study.ask()
    slots.bind_slot(storage.db, study.study_name, slot, trial.number)
    return trial.number


def test_reap_fails_and_retries_only_trials_whose_worker_is_gone(storage_url: str, spec_file: Path) -> None:
    storage = open_storage(storage_url, create=True)
    try:
        spec = load_file(spec_file)
        study = studies.create_or_resume(storage, "r", spec)
        # A live worker: fresh heartbeat, its trial must be left alone.
        live = registry.register(storage.db, "r", "b/cpu:0/1", "cpu:0", heartbeat_s=30)
        live_trial = _running_trial(storage, study, "b/cpu:0/1")
        registry.trial_started(storage.db, live, live_trial)
        # A lost worker: 1 s heartbeat, silent for longer than 3 beats.
        lost = registry.register(storage.db, "r", "a/cpu:0/1", "cpu:0", heartbeat_s=1)
        lost_trial = _running_trial(storage, study, "a/cpu:0/1")
        registry.trial_started(storage.db, lost, lost_trial)
        # A worker that vanished between ask and telling the registry, and one that vanished
        # right after claiming a slot.
        orphan_trial = _running_trial(storage, study, "c/cpu:0/1")
        unbound = slots.claim_slot(storage.db, "r", 10, "d/cpu:0/1")
        time.sleep(4.0)

        background = reap.reap(storage, "r", max_retries=2)
        assert [r.trial_number for r in background] == [lost_trial], "without orphans: stale rows only"
        assert reap.reap(storage, "r", max_retries=2) == [], "a trial is reaped once"
        registry.beat(storage.db, live)  # a live worker beats; a 3 s grace must not take it
        swept = reap.reap(storage, "r", max_retries=2, grace_s=3.0) + reap.retry_orphans(
            storage, "r", max_retries=2, grace_s=3.0
        )
        assert [r.trial_number for r in swept] == [orphan_trial]

        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        assert trials[live_trial].state == TrialState.RUNNING
        for number in (lost_trial, orphan_trial):
            assert trials[number].state == TrialState.FAIL
            assert trials[number].user_attrs["fail_reason"] == "worker_lost"
        retries = [t for t in trials.values() if t.state == TrialState.WAITING]
        assert sorted(t.user_attrs["retry_of"] for t in retries) == [lost_trial, orphan_trial]
        # The live trial keeps its slot; the lost, orphaned and unbound ones are free again.
        assert slots.used_slots(storage.db, "r") == 1
        assert unbound is not None
        [view] = [w for w in liveness.list_workers(storage.db, "r") if w.name == "a/cpu:0/1"]
        assert view.state == "lost" and view.current_trial is None
    finally:
        storage.close()


def test_reaper_thread_waits_out_its_own_outage_before_reaping(storage_url: str, spec_file: Path) -> None:
    storage = open_storage(storage_url, create=True)
    try:
        study = studies.create_or_resume(storage, "r", load_file(spec_file))
        lost = registry.register(storage.db, "r", "a/cpu:0/1", "cpu:0", heartbeat_s=0.3)
        number = _running_trial(storage, study, "a/cpu:0/1")
        registry.trial_started(storage.db, lost, number)
        time.sleep(1.0)  # stale already: 3 beats of 0.3 s
        reaper = reap.Reaper(storage, "r", max_retries=1, interval_s=0.3)
        with reaper:
            # Its own grace (0.9 s of healthy polls) has not passed: nothing is reaped yet.
            time.sleep(0.5)
            assert study.get_trials(deepcopy=False)[number].state == TrialState.RUNNING
            deadline = time.monotonic() + 10
            while study.get_trials(deepcopy=False)[number].state == TrialState.RUNNING:
                assert time.monotonic() < deadline, "the reaper never reaped the stale trial"
                time.sleep(0.1)
        assert study.get_trials(deepcopy=False)[number].user_attrs["fail_reason"] == "worker_lost"
    finally:
        storage.close()


def test_a_start_retries_the_trials_of_this_hosts_gone_workers_and_ends_their_rows(
    storage_url: str, spec_file: Path
) -> None:
    import subprocess

    # A pid that no process has any more: an earlier start's worker.
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead = exited.pid
    storage = open_storage(storage_url, create=True)
    try:
        study = studies.create_or_resume(storage, "r", load_file(spec_file))
        here = registry.this_host()

        def worker(name: str, host: str, pid: int, heartbeat_s: float, trial: bool) -> int | None:
            row = registry.register(storage.db, "r", name, "cpu:0", host=host, pid=pid, heartbeat_s=heartbeat_s)
            if not trial:
                return None
            number = _running_trial(storage, study, name)
            registry.trial_started(storage.db, row, number)
            return number

        gone = worker("gone", here, dead, 0.3, trial=True)
        worker("gone-idle", here, dead, 0.3, trial=False)
        alive = worker("alive", here, os.getpid(), 0.3, trial=True)  # stale, but its process runs
        elsewhere = worker("elsewhere", "another-host", dead, 0.3, trial=True)  # not this host's to judge
        fresh = worker("fresh", here, dead, 30, trial=True)  # beat a moment ago: a namesake host's, maybe
        time.sleep(1.5)  # 3 beats of 0.3 s

        done = reap.retry_gone_here(storage, "r", max_retries=2)
        assert [(r.trial_number, r.retried) for r in done] == [(gone, True)]
        assert reap.retry_gone_here(storage, "r", max_retries=2) == [], "once"

        states = {w.name: (w.state, w.current_trial) for w in liveness.list_workers(storage.db, "r")}
        assert states == {
            "gone": ("finished", None),
            "gone-idle": ("finished", None),
            "alive": ("lost", alive),
            "elsewhere": ("lost", elsewhere),
            "fresh": ("live", fresh),
        }
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        assert trials[gone].state == TrialState.FAIL and trials[gone].user_attrs["fail_reason"] == "worker_lost"
        assert [t.user_attrs["retry_of"] for t in trials.values() if t.state == TrialState.WAITING] == [gone]
        assert all(trials[n].state == TrialState.RUNNING for n in (alive, elsewhere, fresh))
    finally:
        storage.close()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("HPSEARCH_STORAGE", None)
    argv = [sys.executable, "-m", "hpsearch.search.cli.main", *args]
    return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _worker_with_trial(storage, study: optuna.Study, name: str, heartbeat_s: float, host: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    row = registry.register(storage.db, study.study_name, name, "cpu:0", host=host, heartbeat_s=heartbeat_s)
    number = _running_trial(storage, study, name)
    registry.trial_started(storage.db, row, number)
    return row, number


def test_reap_by_hand_judges_each_worker_by_its_own_interval_not_the_shells(storage_url: str, spec_file: Path) -> None:
    storage = open_storage(storage_url, create=True)
    try:
        study = studies.create_or_resume(storage, "r", load_file(spec_file))
        _, slow = _worker_with_trial(storage, study, "slow", 30, "host-a")  # beats every 30 s: live
        _, lost = _worker_with_trial(storage, study, "lost", 0.3, "host-b")  # 3 beats of 0.3 s missed
        time.sleep(1.5)
        # This shell beats every 0.2 s; a 1 s grace is 5 of its beats, and 1/30 of the slow worker's.
        proc = _cli(
            "reap", "--study", "r", "--grace", "1", "--storage", storage_url, env={registry.HEARTBEAT_ENV: "0.2"}
        )
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        [line] = out.splitlines()
        assert line.startswith(f"trial {lost}: worker lost on host-b silent for ") and "retry queued" in line, out + err
        assert "a grace of 1s is shorter than 3 beats of worker slow's own interval (30s): using 90s" in err
        trials = study.get_trials(deepcopy=False)
        assert trials[slow].state == TrialState.RUNNING and trials[lost].state == TrialState.FAIL
    finally:
        storage.close()


def test_reap_by_hand_right_after_an_outage_spares_the_workers_that_beat_again(
    storage_url: str, spec_file: Path
) -> None:
    storage = open_storage(storage_url, create=True)
    try:
        study = studies.create_or_resume(storage, "r", load_file(spec_file))
        back, live = _worker_with_trial(storage, study, "back", 1.0, "host-a")
        _, dead = _worker_with_trial(storage, study, "dead", 1.0, "host-b")
        time.sleep(3.5)  # the outage: no beat reached the database, every row is 3 beats old
        proc = _cli("reap", "--study", "r", "--storage", storage_url)
        assert proc.stderr is not None
        # The database is back: the reaper looks first, then the live worker's beat gets through.
        for line in proc.stderr:
            if "watching them" in line:
                break
        # ... and beats on, once a second, as a live worker does.
        stop = threading.Event()

        def beat_on() -> None:
            while not stop.wait(0.5):
                registry.beat(storage.db, back)

        beating = threading.Thread(target=beat_on)
        registry.beat(storage.db, back)
        beating.start()
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            stop.set()
            beating.join()
        assert proc.returncode == 0, err[-3000:]
        assert [line.split(":")[0] for line in out.splitlines()] == [f"trial {dead}"], out + err
        trials = study.get_trials(deepcopy=False)
        assert trials[live].state == TrialState.RUNNING, "a worker whose beats could not get through is live"
        assert trials[dead].state == TrialState.FAIL
    finally:
        storage.close()


def test_a_reap_pass_survives_a_trial_finished_under_it(
    storage_url: str, spec_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(storage_url, create=True)
    try:
        study = studies.create_or_resume(storage, "r", load_file(spec_file))
        _, slow = _worker_with_trial(storage, study, "slow", 0.2, "host-a")
        _, lost = _worker_with_trial(storage, study, "lost", 0.2, "host-b")
        time.sleep(1.0)
        hand_back = retry.hand_back

        def finished_meanwhile(storage, study, trial_id, **kwargs):  # type: ignore[no-untyped-def]
            # The slow worker tells its result between the reaper's read and its write (a fault
            # injected where the race would put it).
            if storage.optuna.get_trial(trial_id).number == slow:
                study.tell(slow, 0.5)
                storage.optuna.set_trial_user_attr(trial_id, attrs.FAIL_REASON, FailReason.WORKER_LOST.value)
            return hand_back(storage, study, trial_id, **kwargs)

        monkeypatch.setattr(retry, "hand_back", finished_meanwhile)
        done = reap.reap(storage, "r", max_retries=2)
        assert [r.trial_number for r in done] == [lost]
        trials = study.get_trials(deepcopy=False)
        assert trials[slow].state == TrialState.COMPLETE and trials[lost].state == TrialState.FAIL
    finally:
        storage.close()
