"""Fault injection on real processes and the real PostgreSQL: no finished work is lost."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.storage.errors import StudyNotFoundError
from hpsearch.storage.open import open_storage
from tests.conftest import lm_spec_text, spec_text
from tests.support import deleted, netns
from tests.support.hold import Hold


def _spawned_workers(parent: int) -> list[int]:
    """PIDs of the parent's worker children (spawned interpreters, not the resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[1]) == parent and "spawn_main" in cmd:
            pids.append(int(entry.name))
    return pids


SLOW_EPOCHS = 3
"""Of 10 steps each (320 examples / 32), a validation point every 5: room for a fault at step 10 or 15 and a retry
that goes on past it. The trial need not be slow: a test holds it at the step it acts on (``_held_start``)."""


def _slow_spec(tmp_path: Path, model: Path, data: tuple[Path, Path], n_trials: int) -> Path:
    """A spec whose trials are long enough to stop in the middle, with a resumable state at every point."""
    spec = tmp_path / "slow.toml"
    spec.write_text(
        spec_text(model, *data, n_trials=n_trials, search="max_retries = 2", extra_train="resume_every_minutes = 0")
        .replace("epochs = 2", f"epochs = {SLOW_EPOCHS}")
        .replace('pruner = "median"', 'pruner = "none"')
    )
    return spec


def _start(tmp_path: Path, spec: Path, url: str, devices: str = "cpu:1", **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpsearch.search.cli.main",
            "start",
            "--study",
            "f",
            "--config",
            str(spec),
            "--storage",
            url,
            "--devices",
            devices,
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        # Its own process group: a test can take down the whole "host" (supervisor and workers).
        start_new_session=True,
    )


@contextlib.contextmanager
def _held_start(
    tmp_path: Path,
    spec: Path,
    url: str,
    *steps: int,
    rank: int = 0,
    n_trials: int = 1,
    devices: str = "cpu:1",
    **env: str,
) -> Iterator[tuple[subprocess.Popen[str], Hold]]:
    """`start`, its trial held at ``steps[0]`` (its rank's pid in ``hold.pid``) once its report at that step is in the
    study: the test acts on a RUNNING trial that cannot finish first. The hold is let go (``hold.wait`` moves on to
    the next of ``steps``) and the start killed when the block ends."""
    with Hold(*steps, rank=rank) as hold:
        proc = _start(tmp_path, spec, url, devices, **hold.with_faults(**env))
        try:
            hold.wait(proc)
            _wait_for_report(_sa_url(url), min_step=steps[0], proc=proc, n_trials=n_trials)
            yield proc, hold
        finally:
            if proc.poll() is None:  # the test failed: take its workers down too, saying first where each one was
                os.killpg(proc.pid, signal.SIGQUIT)
                time.sleep(1)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                for dump in sorted(hold.path.parent.glob("*.stacks")):
                    print(f"--- {dump.name}\n{dump.read_text()[-6000:]}")


def _trials_so_far(url: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, read as `hpsearch status` reads them. Not plain Optuna: this poll runs
    while `start` creates the schema, and Optuna writes its version rows on opening a storage
    that lacks them, so a plain reader could lose that race (a UNIQUE constraint failure)."""
    try:
        storage = open_storage(url, create=False, read_only=True)
    except StudyNotFoundError:
        return []  # `start` has not made the schema yet
    try:
        return optuna.load_study(study_name="f", storage=storage.optuna).get_trials(deepcopy=False)
    except KeyError:
        return []  # nor the study
    finally:
        storage.close()


def _wait_for_report(
    url: str, min_step: int, timeout: float = 600, proc: subprocess.Popen[str] | None = None, n_trials: int = 1
) -> None:
    """Until a RUNNING trial has reported at ``min_step`` or later. A test that acts on that trial holds it there
    first (tests/support/hold.py), so that it cannot finish before the test acts: this then only waits for the
    report, which the trial sends on a background thread. Fails at once when no trial can reach the point any
    more: ``proc`` (the start) exited, or ``n_trials`` trials have finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trials = _trials_so_far(url)
        if any(
            t.state == TrialState.RUNNING and t.intermediate_values and max(t.intermediate_values) >= min_step
            for t in trials
        ):
            return
        if proc is not None and proc.poll() is not None:
            # Not a wait of minutes for a search that is over: say how it ended.
            _, err = proc.communicate()
            raise AssertionError(f"start exited ({proc.returncode}) before a report at step {min_step}: {err[-3000:]}")
        if sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials) >= n_trials:
            raise AssertionError(f"the search ended before a report at step {min_step}: {_states(trials)}")
        time.sleep(0.2)
    raise AssertionError(f"no trial reached a validation point in time: {_states(_trials_so_far(url))}")


def _states(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[int, str, int | None]]:
    return [(t.number, t.state.name, max(t.intermediate_values, default=None)) for t in trials]


def _sa_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg2://", 1)


def _assert_recovered(url: str, n_trials: int, reason: str, runs: Path) -> None:
    study = optuna.load_study(study_name="f", storage=_sa_url(url))
    trials = study.get_trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == n_trials, [(t.number, t.state, t.user_attrs) for t in trials]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["fail_reason"].startswith(reason)
    # The failed attempt's device time counts against gpu_hours, whoever handed it back.
    assert failed[0].user_attrs["device_seconds"] > 0, failed[0].user_attrs
    # Its record marks a folder that is gone (its retry took the best model over, or it was swept); the path stays.
    note, gone = failed[0].user_attrs.get("best_checkpoint"), deleted.why(study, failed[0].number)
    assert note is None or Path(note).is_dir() is (gone is None), (note, gone)
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == failed[0].number)
    assert retry.params == failed[0].params
    assert retry.user_attrs["resumed_from_step"] > 0
    # The retry continued: it reports only steps after the resume point.
    assert min(retry.intermediate_values) > retry.user_attrs["resumed_from_step"]
    # Its best model is on record even when the best point came before the interruption
    # (the model is moved into the retry's folder), and it is the model the value belongs to.
    for t in trials:
        if t.state == TrialState.COMPLETE:
            best = Path(t.user_attrs["best_checkpoint"])
            meta = json.loads((best / "hpsearch.json").read_text())
            assert meta["step"] == t.user_attrs["best_step"] and best.parent == runs / "f" / f"trial-{t.number}"
            assert any(v == pytest.approx(t.value) for k, v in meta.items() if k.startswith("val_")), (t.value, meta)
    # Every attempt's resumable state is gone once its trial has ended, the failed one's included.
    assert not list(runs.glob("f/trial-*/resume")), list(runs.glob("f/trial-*/resume"))


@pytest.mark.parametrize("sig,reason", [(signal.SIGKILL, "worker_crash"), (signal.SIGTERM, "interrupted")])
def test_killed_worker_trial_is_retried_from_its_checkpoint(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str, sig: int, reason: str
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=2)
    with _held_start(tmp_path, spec, pg_url, 10, n_trials=2) as (proc, hold):
        assert _spawned_workers(proc.pid) == [hold.pid]
        os.kill(hold.pid, sig)
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    _assert_recovered(pg_url, 2, reason, tmp_path / "runs")


def test_a_dead_peer_rank_hands_the_trial_back_and_the_group_restarts(
    tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path], sqlite_url: str
) -> None:
    spec = tmp_path / "dp.toml"
    # 192 examples, batch 16: 12 steps, a point every 4; rank 1 is held (and killed) at step 4.
    spec.write_text(
        lm_spec_text(tiny_gpt2, *lm_files, extra_train="devices_per_trial = 2", search="max_retries = 2").replace(
            'pruner = "median"', 'pruner = "none"'
        )
    )
    with _held_start(tmp_path, spec, sqlite_url, 4, rank=1, devices="cpu:2") as (proc, hold):
        (rank0,) = _spawned_workers(proc.pid)
        (rank1,) = _spawned_workers(rank0)
        assert hold.pid == rank1
        os.kill(rank1, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"peer rank 1 (pid {rank1}) died (signal SIGKILL)" in err
    _assert_recovered(sqlite_url, 1, "worker_crash (a peer rank died)", tmp_path / "runs")
    retry = optuna.load_study(study_name="f", storage=sqlite_url).best_trial
    digests = retry.user_attrs["rank_parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "the restarted ranks resumed the same state"


@pytest.mark.parametrize("whole_group", [False, True], ids=["supervisor", "process-group"])
def test_sigterm_of_start_hands_back_and_next_start_resumes(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str, whole_group: bool
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    with _held_start(tmp_path, spec, sqlite_url, 10) as (proc, _):
        t0 = time.monotonic()
        if whole_group:
            # A shutdown (or `kill -TERM -PGID`) signals the workers as well as the supervisor:
            # that is one stop, not the "second signal, exit now" of a double Ctrl-C.
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)  # what AutoDL sends at shutdown
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30, "must exit within 30 s of SIGTERM"
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    # The summary reads like a stop: the trial handed back waits, and the line to resume it is there to paste.
    assert "stopped: the search was stopped (SIGTERM); trial 0 was handed back and waits to resume" in out, out
    resume = f"hpsearch start --study f --config {spec} --devices cpu:1 --output-dir {tmp_path / 'runs'} --storage"
    assert f"  resume with: {resume} {sqlite_url}\n" in out, out
    assert "best: none yet; no trial completed before the stop" in out and "fix:" not in out, out
    again = _start(tmp_path, spec, sqlite_url)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    _assert_recovered(sqlite_url, 1, "interrupted", tmp_path / "runs")


def test_database_restart_under_a_running_worker_loses_nothing(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    from tests.support.pgcluster import Cluster

    cluster = Cluster()
    try:
        cluster.start()
        url = cluster.url
        spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=2)
        with _held_start(tmp_path, spec, url, 5, 15, n_trials=2) as (proc, hold):
            cluster.stop("fast")  # every connection of the worker is cut
            down = time.time()
            hold.wait(proc)  # the worker trained on to its points at 10 and 15 while the server is away
            up = time.time()
            cluster.start()
            hold.release()
            _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "database unreachable" in err or "transient database error" in err, "the outage was seen"
        trials = optuna.load_study(study_name="f", storage=_sa_url(url)).get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE], [
            (t.state, t.user_attrs) for t in trials
        ]
        for t in trials:
            # 10 steps per epoch, validation every 5: nothing lost.
            assert sorted(t.intermediate_values) == list(range(5, 10 * SLOW_EPOCHS + 1, 5))
        # Training did not wait for the database: validation points came and went while it was
        # down (a loop that waited at its report would log one at most).
        during = [t for t in _validation_times(tmp_path / "runs" / "f") if down < t < up]
        assert len(during) >= 2, (down, up, _validation_times(tmp_path / "runs" / "f"))
    finally:
        cluster.destroy()


def _validation_times(study_dir: Path) -> list[float]:
    """When each validation point of the study's trials was logged (their train.log files)."""
    import datetime

    times = []
    for log_file in study_dir.glob("trial-*/train.log"):
        for line in log_file.read_text().splitlines():
            if " step " in line and " train_loss " in line:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                times.append(stamp.timestamp())
    return sorted(times)


@pytest.mark.parametrize("outage", ["server-down", "partition", "frozen-server"])
def test_sigterm_during_a_database_outage_exits_soon_and_the_retry_resumes_where_it_stopped(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], outage: str
) -> None:
    from tests.support.pgcluster import Cluster

    # The worker is stopped while its storage calls cannot get through. "server-down": the
    # server is stopped, so calls fail at once and are retried (for minutes, before a stop
    # cut the retries short). The database can also go silent, so that calls hang instead:
    # "partition", it runs on another "host" whose network path is cut (no reset, packets go
    # unanswered) and a hung call ends only when the connection is declared dead (it held
    # the stop 164 s); "frozen-server", its processes are stopped as in a frozen VM, and its
    # kernel still acknowledges, so a call never ends (the stop waited for ever). The worker
    # must neither wait for the database nor exit before its resumable state is on disk.
    if outage == "partition" and not netns.available():
        pytest.skip("needs root and iproute2 to make a network namespace")
    # No periodic resumable state: the only one is what the worker saves when it stops.
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    spec.write_text(spec.read_text().replace("resume_every_minutes = 0", "resume_every_minutes = 60"))
    host = netns.Host() if outage == "partition" else None
    cluster = Cluster(host=host)
    begin: Callable[[], None]
    end: Callable[[], None]
    if host is not None:
        begin, end = host.cut, host.heal
    elif outage == "frozen-server":
        begin, end = cluster.freeze, cluster.thaw
    else:
        begin, end = (lambda: cluster.stop("fast")), cluster.start
    try:
        cluster.start()
        url = cluster.url
        with _held_start(tmp_path, spec, url, 10, 15, HPSEARCH_HEARTBEAT_S="1") as (proc, hold):
            begin()
            hold.wait(proc, timeout=120)  # the worker trained on to its point at 15, its report waiting on the database
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # the instance shuts down while the database is away
            _, err = proc.communicate(timeout=600)
            took = time.monotonic() - t0
        assert took < 60, f"exited {took:.0f} s after SIGTERM"
        assert "Traceback" not in err, err[-3000:]
        assert list((tmp_path / "runs" / "f").glob("trial-0/resume/state.pt")), err[-3000:]
        assert "stopped without reaching the storage" in err, err[-3000:]
        end()
        # The default heartbeat (30 s) this time: a reaper would wait 90 s of healthy connection
        # before it judged the old worker lost. The new start knows its own host's dead
        # processes: it retries their trial at once and ends their rows.
        again = _start(tmp_path, spec, url)
        _, err = again.communicate(timeout=600)
        assert again.returncode == 0, err[-3000:]
        assert "waiting for trial(s)" not in err and "of this host is gone" in err, err[-3000:]
        _assert_recovered(url, 1, "worker_lost", tmp_path / "runs")
        status = _cli(tmp_path, "status", "--study", "f", "--storage", url)
        assert "0 live, 0 lost, 2 finished" in status.stdout, status.stdout + status.stderr
        [retry] = [t for t in optuna.load_study(study_name="f", storage=_sa_url(url)).get_trials() if t.number == 1]
        # It resumed from the state saved at the stop, past the last validation point reported.
        assert retry.user_attrs["resumed_from_step"] > 10, retry.user_attrs
    finally:
        cluster.destroy()
        if host is not None:
            host.destroy()


def test_a_worker_that_starts_during_an_outage_waits_for_the_storage_or_a_stop() -> None:
    import threading

    from hpsearch.search.workers.stop_signals import StopFlag, open_retrying
    from hpsearch.storage.db import OUTAGE_RETRY
    from hpsearch.storage.open import open_storage
    from tests.support.pgcluster import Cluster

    cluster = Cluster()
    try:
        cluster.start()
        open_storage(cluster.url, create=True).close()  # a storage whose worker is being spawned
        # The server goes away just as the worker opens the storage, and is back 3 s later:
        # the worker waits for it, as every later storage call would (it used to crash, and
        # three crashes in a row gave its device up).
        cluster.stop("fast")
        restart = threading.Timer(3.0, cluster.start)
        restart.start()
        began = time.monotonic()
        storage = open_retrying(cluster.url, OUTAGE_RETRY, StopFlag())
        assert storage is not None and time.monotonic() - began > 2
        storage.close()
        # The worker may connect before `pg_ctl -w start` has seen the server up; stopped under
        # it, pg_ctl would fail in the timer's thread.
        restart.join()
        # A stop while it waits: it holds no trial yet, so it just goes.
        cluster.stop("fast")
        stop = StopFlag()
        threading.Timer(1.0, stop.request, args=(signal.SIGTERM, "test")).start()
        began = time.monotonic()
        assert open_retrying(cluster.url, OUTAGE_RETRY, stop) is None
        assert time.monotonic() - began < 10
    finally:
        cluster.destroy()


def _lose_host(tmp_path: Path, spec: Path, url: str) -> None:
    """Run the search on "host-a" until its trial has a resumable checkpoint, then pull the plug:
    supervisor and worker die at once, so nobody on host-a hands the trial back."""
    with _held_start(tmp_path, spec, url, 10, HPSEARCH_HOST="host-a", HPSEARCH_HEARTBEAT_S="1") as (host_a, _):
        os.killpg(host_a.pid, signal.SIGKILL)
        host_a.wait(timeout=30)
    [trial] = optuna.load_study(study_name="f", storage=_sa_url(url)).get_trials()
    assert trial.state == TrialState.RUNNING and trial.user_attrs["resume_checkpoint"]


def _cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli.main", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lost_host_is_marked_stale_and_reap_retries_its_trial(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    _lose_host(tmp_path, spec, pg_url)
    time.sleep(4)  # past 3 missed beats of host-a's 1 s heartbeat, by the database clock
    status = _cli(tmp_path, "status", "--study", "f", "--storage", pg_url)
    assert status.returncode == 0 and "stale: trial 0" in status.stdout, status.stdout + status.stderr
    reaped = _cli(tmp_path, "reap", "--study", "f", "--storage", pg_url)
    assert reaped.returncode == 0 and "trial 0: worker host-a/cpu:0/" in reaped.stdout, reaped.stdout
    assert "retry queued" in reaped.stdout
    again = _cli(tmp_path, "reap", "--study", "f", "--storage", pg_url)
    assert again.stdout.strip() == "no stale trials", "a trial is reaped once"
    # The instance comes back (same disk): a new start runs the retry from its checkpoint.
    restart = _start(tmp_path, spec, pg_url, HPSEARCH_HOST="host-a")
    _, err = restart.communicate(timeout=600)
    assert restart.returncode == 0, err[-3000:]
    _assert_recovered(pg_url, 1, "worker_lost", tmp_path / "runs")


def test_a_worker_on_another_host_reaps_the_lost_trial_and_resumes_it(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    _lose_host(tmp_path, spec, pg_url)
    # host-b finds the budget taken by the lost trial: it waits, its reaper fails the trial
    # after the grace period, and it runs the retry (resuming, as the output folder is shared).
    host_b = _start(tmp_path, spec, pg_url, HPSEARCH_HOST="host-b", HPSEARCH_HEARTBEAT_S="1")
    _, err = host_b.communicate(timeout=600)
    assert host_b.returncode == 0, err[-3000:]
    assert "waiting for trial(s) 0" in err
    _assert_recovered(pg_url, 1, "worker_lost", tmp_path / "runs")
    trials = optuna.load_study(study_name="f", storage=_sa_url(pg_url)).get_trials()
    assert {t.user_attrs["host"] for t in trials} == {"host-a", "host-b"}
