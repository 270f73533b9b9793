"""Three hosts join one study on the real PostgreSQL server, as three users would: each runs
`hpsearch worker` with only the study name and the storage URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from hpsearch.search.study import spec as specs, studies
from hpsearch.storage import liveness, registry
from hpsearch.storage.open import open_storage
from hpsearch.storage.tables import TrialSlot
from tests.conftest import Cli, hpsearch, spec_text
from tests.support.tiny import write_demo_split

HOSTS = ("instance-a", "instance-b", "instance-c")
N_TRIALS = 6


def _quick_spec(tmp_path: Path, tiny_model: Path) -> specs.StudySpec:
    # Two optimizer steps per trial: the test is about who runs which trial, not about training.
    train = write_demo_split(tmp_path / "train.jsonl", 64, 1)
    dev = write_demo_split(tmp_path / "dev.jsonl", 32, 2)
    text = spec_text(tiny_model, train, dev, n_trials=N_TRIALS).replace("epochs = 2", "epochs = 1")
    path = tmp_path / "spec.toml"
    path.write_text(text.replace("eval_every = 5", "eval_every = 1"))
    return specs.load_file(path)


def _worker(host: str, url: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        registry.HOST_ENV: host,
        # Not the 1 s of the fault tests: nothing here is lost, and at a load of 16 a worker stalled past three 1 s
        # beats was judged lost once (its trial retried: 7 trials instead of 6).
        registry.HEARTBEAT_ENV: "5",
    }
    env.pop("HPSEARCH_STORAGE", None)
    # Separate working folders, as on separate instances; only the study name and URL are shared.
    cwd = tmp_path / host
    cwd.mkdir()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpsearch.search.cli.main",
            "worker",
            "--study",
            "shared",
            "--storage",
            url,
            "--devices",
            "cpu:1",
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_three_hosts_share_one_study_exactly(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Path, pg_url: str
) -> None:
    storage = open_storage(pg_url, create=True)
    try:
        studies.create_or_resume(storage, "shared", _quick_spec(tmp_path, tiny_model))
    finally:
        storage.close()

    procs = [_worker(h, pg_url, tmp_path) for h in HOSTS]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for host, out in zip(HOSTS, outputs, strict=True):
        (tmp_path / host / "worker.log").write_text(out)
    for host, p, out in zip(HOSTS, procs, outputs, strict=True):
        assert p.returncode == 0, f"{host}:\n{out[-3000:]}"

    storage = open_storage(pg_url, create=False)
    try:
        study = optuna.load_study(study_name="shared", storage=storage.optuna)
        trials = study.get_trials()
        workers = liveness.list_workers(storage.db, "shared")
        with storage.db.session() as s:
            slots = s.execute(
                sqlalchemy.select(TrialSlot.slot, TrialSlot.trial_number).where(TrialSlot.study_name == "shared")
            ).all()
    finally:
        storage.close()

    # The budget is exact and every trial ran once: no retries, no duplicate parameters.
    assert len(trials) == N_TRIALS
    assert {t.state for t in trials} <= {
        optuna.trial.TrialState.COMPLETE,
        optuna.trial.TrialState.PRUNED,
    }
    assert sorted(n for _, n in slots) == list(range(N_TRIALS))
    assert not any("retry_of" in t.user_attrs for t in trials)
    assert len({t.params["learning_rate"] for t in trials}) == N_TRIALS
    assert {t.user_attrs["host"] for t in trials} <= set(HOSTS)

    # The registry shows all three hosts, cleanly finished, accounting for every trial.
    assert sorted(w.host for w in workers) == sorted(HOSTS)
    assert {w.state for w in workers} == {"finished"}
    assert sum(w.trials_finished for w in workers) == N_TRIALS
    by_name = {w.name: w for w in workers}
    for t in trials:
        ran = by_name[t.user_attrs["worker"]]
        assert ran.host == t.user_attrs["host"]
    for w in workers:
        assert w.device == "cpu:0" and w.device_seconds >= 0

    status = cli("status", "--study", "shared", "--storage", pg_url, "--json", cwd=tmp_path)
    data = json.loads(status.stdout)
    assert data["workers_by_state"] == {"live": 0, "lost": 0, "finished": 3}
    # CPU workers: CPU-h, and no GPU-h at all.
    assert data["device_hours"] == {"CPU-h": pytest.approx(sum(w.device_seconds for w in workers) / 3600)}
    text = cli("status", "--study", "shared", "--storage", pg_url, cwd=tmp_path).stdout
    assert "workers: 0 live, 0 lost, 3 finished" in text
    for host in HOSTS:
        assert host in text

    # `best` names the host holding the checkpoint and warns everywhere else.
    best = json.loads(cli("best", "--study", "shared", "--storage", pg_url, "--json", cwd=tmp_path).stdout)
    monkeypatch.setenv(registry.HOST_ENV, best["host"])
    here = cli("best", "--study", "shared", "--storage", pg_url, cwd=tmp_path).stdout
    monkeypatch.setenv(registry.HOST_ENV, "instance-z")
    elsewhere = cli("best", "--study", "shared", "--storage", pg_url, cwd=tmp_path).stdout
    assert best["best_checkpoint"].startswith(str(tmp_path / best["host"]))
    assert "warning" not in here
    assert f"the checkpoint lives on host {best['host']}, not on this host" in elsewhere


def test_worker_refuses_a_study_that_does_not_exist(cli: Cli, tmp_path: Path, storage_url: str) -> None:
    open_storage(storage_url, create=True).close()
    argv = ("worker", "--study", "nope", "--storage", storage_url, "--devices", "cpu:1")
    # A real process once (SQLite): no traceback there either; on PostgreSQL the same main() runs in-process.
    result = hpsearch(*argv, cwd=tmp_path) if storage_url.startswith("sqlite") else cli(*argv, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "study 'nope' does not exist" in lines[0], result.stderr
    storage = open_storage(storage_url, create=False)
    try:
        assert storage.optuna.get_all_studies() == []
        assert liveness.list_workers(storage.db, "nope") == []
    finally:
        storage.close()
