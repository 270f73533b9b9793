"""The reaper on both storage backends: which trials it fails and retries, and which it leaves alone.

The end-to-end cases (a whole host killed, `hpsearch reap`, a worker on another host taking
over) run real processes in test_faults.py; here the registry rows are written directly so
each rule is checked on its own, on SQLite and the real PostgreSQL.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from hpsearch.search import reap, study as studies
from hpsearch.search.spec import load_file
from hpsearch.storage import budget, registry
from hpsearch.storage.open import open_storage


def _running_trial(storage, study: optuna.Study, worker: str) -> int:  # type: ignore[no-untyped-def]
    """What a worker does before training: claim a budget slot, ask, bind."""
    slot = budget.claim_slot(storage.db, study.study_name, 10, worker)
    assert slot is not None
    trial = study.ask()
    budget.bind_slot(storage.db, study.study_name, slot, trial.number)
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
        unbound = budget.claim_slot(storage.db, "r", 10, "d/cpu:0/1")
        time.sleep(4.0)

        background = reap.reap(storage, "r", max_retries=2)
        assert [r.trial_number for r in background] == [lost_trial], "without orphans: stale rows only"
        assert reap.reap(storage, "r", max_retries=2) == [], "a trial is reaped once"
        registry.beat(storage.db, live)  # a live worker beats; a 3 s grace must not take it
        swept = reap.reap(storage, "r", max_retries=2, grace_s=3.0, orphans=True)
        assert [r.trial_number for r in swept] == [orphan_trial]

        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        assert trials[live_trial].state == TrialState.RUNNING
        for number in (lost_trial, orphan_trial):
            assert trials[number].state == TrialState.FAIL
            assert trials[number].user_attrs["fail_reason"] == "worker_lost"
        retries = [t for t in trials.values() if t.state == TrialState.WAITING]
        assert sorted(t.user_attrs["retry_of"] for t in retries) == [lost_trial, orphan_trial]
        # The live trial keeps its slot; the lost, orphaned and unbound ones are free again.
        assert budget.used_slots(storage.db, "r") == 1
        assert unbound is not None
        [view] = [w for w in registry.list_workers(storage.db, "r") if w.name == "a/cpu:0/1"]
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

        done = reap.reap_gone_here(storage, "r", max_retries=2)
        assert [(r.trial_number, r.retried) for r in done] == [(gone, True)]
        assert reap.reap_gone_here(storage, "r", max_retries=2) == [], "once"

        states = {w.name: (w.state, w.current_trial) for w in registry.list_workers(storage.db, "r")}
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
