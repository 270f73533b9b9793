"""`hpsearch dashboard` on a finished study: HTTP answers, study note, bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
import pytest

from tests.conftest import hpsearch, spec_text, start_study

STUDY = "seen"


def finished_study(tmp_path_factory: pytest.TempPathFactory, model: Path, data: tuple[Path, Path]) -> str:
    """A study finished by the real CLI (2 trials on SQLite), trained once per test session.

    Shared by this module and the browser test through a folder of the session's temp root
    (a conftest fixture would do the same, but this keeps the feature's tests in its files).
    """
    root = tmp_path_factory.getbasetemp() / "dashboard-study"
    url = f"sqlite:///{root / 'study.db'}"
    if (root / "done").exists():
        return url
    root.mkdir(exist_ok=True)
    spec = root / "spec.toml"
    spec.write_text(spec_text(model, *data))
    start_study(STUDY, spec, url, root)
    (root / "done").touch()
    return url


@pytest.fixture(scope="module")
def sqlite_study(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> str:
    return finished_study(tmp_path_factory, tiny_model, demo_files)


def spawn_dashboard(*args: str, cwd: Path, unset: tuple[str, ...] = ("HPSEARCH_STORAGE",)) -> subprocess.Popen[str]:
    """`hpsearch dashboard ... --port 0` as a user starts it, without the ``unset`` variables."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in unset:
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "hpsearch.search.cli.main", "dashboard", *args, "--port", "0"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def dashboard(*args: str, cwd: Path, timeout: float = 120) -> Iterator[str]:
    """Run `hpsearch dashboard ... --port 0` and yield the URL it prints."""
    proc = spawn_dashboard(*args, cwd=cwd)
    try:
        url, printed = None, []
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"dashboard exited: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")
            printed.append(line)
            if line.strip().startswith("open http://"):
                url = line.split("open ", 1)[1].strip()
        assert url, printed
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_dashboard_serves_the_study_and_its_trials(tmp_path: Path, sqlite_study: str) -> None:
    with dashboard("--study", STUDY, "--storage", sqlite_study, cwd=tmp_path) as url:
        assert url.startswith("http://127.0.0.1:") and "/dashboard/studies/" in url
        base, study_id = url.split("/dashboard/studies/")
        studies = get_json(f"{base}/api/studies")["study_summaries"]
        assert [s["study_name"] for s in studies] == [STUDY]
        detail = get_json(f"{base}/api/studies/{study_id}")
        page = urllib.request.urlopen(url, timeout=60).read().decode()
        importance = get_json(f"{base}/api/studies/{study_id}/param_importances")
    assert "<title>Optuna Dashboard" in page
    trials = detail["trials"]
    assert [t["number"] for t in trials] == [0, 1]
    assert {t["state"] for t in trials} <= {"Complete", "Pruned"}
    for t in trials:
        attrs = {a["key"]: a["value"] for a in t["user_attrs"]}
        for key in ("device", "host", "worker"):
            assert attrs[key], key
        # Every trial's validation curve is there, at optimizer steps 5, 10, ...
        steps = [v["step"] for v in t["intermediate_values"]]
        assert steps and steps[0] == 5 and steps == sorted(steps)
        if t["state"] == "Complete":
            assert Path(attrs["best_checkpoint"]).is_dir()
            assert float(attrs["train_samples_per_second"]) > 0 and float(attrs["peak_memory_mb"]) > 0
    assert [p["name"] for p in importance["param_importances"][0]] == ["learning_rate"]
    # The study note summarises budget and best checkpoint, as of the last finished trial.
    best = optuna.load_study(study_name=STUDY, storage=sqlite_study).best_trial
    body = detail["note"]["body"]
    assert "**Budget:** 2 of 2 trials finished" in body
    assert f"trial {best.number}" in body and best.user_attrs["best_checkpoint"] in body
    assert "| `learning_rate` | float: 0.0001 to 0.003 (log) |" in body


def test_dashboard_on_postgresql_refreshes_the_note(tmp_path: Path, sqlite_study: str, pg_url: str) -> None:
    # The same finished study, copied into a PostgreSQL database with a stale note: the
    # dashboard serves it from there and brings the note up to date on start.
    pg = pg_url.replace("postgresql://", "postgresql+psycopg2://", 1)
    optuna.copy_study(from_study_name=STUDY, from_storage=sqlite_study, to_storage=pg)
    from optuna_dashboard import save_note

    save_note(optuna.load_study(study_name=STUDY, storage=pg), "stale")
    with dashboard("--study", STUDY, "--storage", pg_url, cwd=tmp_path) as url:
        base, study_id = url.split("/dashboard/studies/")
        detail = get_json(f"{base}/api/studies/{study_id}")
    assert len(detail["trials"]) == 2
    assert detail["note"]["body"].startswith(f"## hpsearch study `{STUDY}`")
    assert "2 of 2 trials finished" in detail["note"]["body"]


def test_dashboard_lists_all_studies_without_study(tmp_path: Path, sqlite_study: str) -> None:
    with dashboard("--storage", sqlite_study, cwd=tmp_path) as url:
        assert url.endswith("/dashboard")
        assert get_json(url.replace("/dashboard", "/api/studies"))["study_summaries"][0]["study_name"] == STUDY


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--study", "nope"], "study 'nope' does not exist"),
        (["--study", STUDY, "--port", "70000"], "--port 70000: must be between 1 and 65535"),
        (
            ["--study", STUDY, "--host", "203.0.113.9"],
            "--host 203.0.113.9: not an address of this machine",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, sqlite_study: str, args: list[str], expected: str) -> None:
    result = hpsearch("dashboard", "--storage", sqlite_study, *args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_storage_file_is_exit_2_and_creates_nothing(tmp_path: Path) -> None:
    result = hpsearch("dashboard", "--storage", f"sqlite:///{tmp_path / 'none.db'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "no study storage at" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "none.db").exists()


def test_port_in_use_names_another_port(tmp_path: Path, sqlite_study: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = hpsearch("dashboard", "--storage", sqlite_study, "--port", str(port), cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert f"--port {port + 1}" in result.stderr


def test_binds_localhost_by_default_and_says_how_to_reach_it(sqlite_study: str) -> None:
    from hpsearch.search.views import dashboard as dash

    served = dash.create(sqlite_study, STUDY, port=0)
    try:
        assert served.server.server_address[0] == "127.0.0.1"
        text = dash.how_to_reach(served, "127.0.0.1", STUDY, "sqlite:///x.db")
    finally:
        served.server.server_close()
        served.storage.engine.dispose()
    port = served.port
    assert f"ssh -N -L 127.0.0.1:{port}:127.0.0.1:{port} -p SSH_PORT root@SSH_HOST" in text
    assert "--host 0.0.0.0 --port 6006" in text and "-g" not in text
