"""Bad storage input: one line, exit code 2, no part of a password, and the storage left as it was."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from hpsearch.search.study import studies
from hpsearch.search.study.spec import load_file
from hpsearch.storage import urls
from hpsearch.storage.open import open_storage
from tests.conftest import hpsearch

COMMANDS = ["start", "worker", "status", "best", "reap", "dashboard"]


def _error_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The refusal: exit 2, no traceback, and the last line is `hpsearch COMMAND: error: ...`
    (a `start` may log a line or two first while it reads the data)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hpsearch {command}: error: "), result.stderr[-3000:]
    assert sum("error" in line for line in result.stderr.splitlines()) == 1, result.stderr[-3000:]
    return last


@contextmanager
def _read_only(folder: Path) -> Iterator[list[str]]:
    """The real CLI's command line while ``folder`` is read-only. root writes through mode bits,
    so for root the folder becomes a read-only bind mount in a private mount namespace."""
    cli = [sys.executable, "-m", "hpsearch.search.cli.main"]
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield cli
        finally:
            folder.chmod(0o755)
        return
    try:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    except FileNotFoundError:
        pytest.skip("running as root without unshare: cannot make a folder read-only")
    if probe.returncode:
        pytest.skip("running as root and unshare -m is refused: cannot make a folder read-only")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    yield ["unshare", "-m", "sh", "-c", script, str(folder), *cli]


def _cli_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("HPSEARCH_STORAGE", None)
    return env


def _hpsearch_read_only(folder: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    with _read_only(folder) as cli:
        return subprocess.run([*cli, *args], cwd=cwd, env=_cli_env(), capture_output=True, text=True, timeout=600)


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()


def _tables(url: str) -> set[str]:
    engine = sqlalchemy.create_engine(urls.normalize(url))
    try:
        return set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _hpsearch_study(path: Path, spec_file: Path) -> Path:
    """An hpsearch study 's' (no trials yet) in the SQLite file ``path``, made as `start` makes it."""
    storage = open_storage(f"sqlite:///{path}", create=True)
    try:
        studies.create_or_resume(storage, "s", load_file(spec_file))
    finally:
        storage.close()
    return path


# -- 1. passwords -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_password_with_an_unescaped_at_is_never_printed(tmp_path: Path, command: str) -> None:
    url = "postgresql://postgres:S3cr@tPW@127.0.0.1:5432/somedb"
    result = hpsearch(command, "--study", "x", "--storage", url, cwd=tmp_path)
    line = _error_line(result, command)
    for piece in ("S3cr", "tPW", "S3cr@tPW"):
        assert piece not in result.stderr + result.stdout, f"{piece!r} of the password was printed: {line}"
    assert "127.0.0.1:5432/somedb" in line, "the host is still named"
    assert "'@'" in line and "%40" in line, f"the fix (write '@' as %40) is not given: {line}"
    assert not (tmp_path / "hpsearch.db").exists()


@pytest.mark.parametrize(
    "url,secret",
    [
        ("postgresql://hp:S3cr@tPW@10.0.0.5:5432/db", ("S3cr", "tPW")),
        # The parser ends the password at the first "@" and reads "cD/eF" as host and path.
        ("postgresql://hp:aB@cD/eF@10.0.0.5/db", ("aB", "cD", "eF")),
        # A "/" in the user name: the parser finds no user and reads it all as host and path.
        ("postgresql://h/p:pw9x@10.0.0.5/db", ("pw9x",)),
        ("postgresql://hp:pQ?x@yZ@10.0.0.5/db", ("pQ", "yZ")),
        # One slash: no parser reads it, and it is echoed in the "not a URL" message.
        ("postgresql:/hp:pw9x@10.0.0.5/db", ("pw9x",)),
    ],
)
def test_mask_and_refusal_show_no_part_of_a_password(url: str, secret: tuple[str, ...]) -> None:
    masked = urls.mask(url)
    assert masked.endswith("@10.0.0.5:5432/db") or masked.endswith("@10.0.0.5/db"), masked
    assert not any(s in masked for s in secret), masked
    with pytest.raises(Exception) as refused:
        urls.normalize(url)
    assert not any(s in str(refused.value) for s in secret), str(refused.value)
    assert "%" in str(refused.value) or "not a URL" in str(refused.value), str(refused.value)


def test_a_percent_encoded_at_still_works() -> None:
    url = "postgresql://hp:S3cr%40tPW@10.0.0.5:5432/db"
    assert urls.parse(url).password == "S3cr@tPW" and urls.parse(url).host == "10.0.0.5"
    assert urls.mask(url) == "postgresql://hp:***@10.0.0.5:5432/db"
    assert urls.mask("sqlite:////data/a@b.db") == "sqlite:////data/a@b.db", "no password in a SQLite path"


# -- 2. SQLite files that cannot be used ------------------------------------------------------


def test_start_in_a_folder_that_cannot_be_written(tmp_path: Path, spec_file: Path) -> None:
    start = ("start", "--study", "x", "--config", str(spec_file), "--devices", "cpu:1")
    out = ("--output-dir", str(tmp_path / "runs"))
    # /proc takes no new files, for root too.
    line = _error_line(hpsearch(*start, "--storage", "sqlite:////proc/x.db", *out, cwd=tmp_path), "start")
    assert "cannot create SQLite storage sqlite:////proc/x.db: folder /proc is not writable; point --storage" in line
    folder = tmp_path / "locked"
    folder.mkdir()
    result = _hpsearch_read_only(folder, *start, "--storage", f"sqlite:///{folder / 'x.db'}", *out, cwd=tmp_path)
    line = _error_line(result, "start")
    assert f"cannot create SQLite storage sqlite:///{folder / 'x.db'}: folder {folder} is not writable" in line
    assert not (folder / "x.db").exists()


def test_a_device_is_not_a_database(tmp_path: Path, spec_file: Path) -> None:
    start = ("start", "--study", "x", "--config", str(spec_file), "--devices", "cpu:1")
    result = hpsearch(*start, "--storage", "sqlite:////dev/null", "--output-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert "/dev/null is not a regular file, so not a database" in _error_line(result, "start")
    result = hpsearch("status", "--study", "x", "--storage", "sqlite:////dev/null", cwd=tmp_path)
    assert "/dev/null is not a regular file, so not a database" in _error_line(result, "status")


def test_a_study_in_a_read_only_folder_can_be_read_not_written(tmp_path: Path, spec_file: Path) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    db = _hpsearch_study(folder / "study.db", spec_file)
    assert _journal_mode(db) == "wal", "a study is created in WAL mode"
    before = db.read_bytes()
    url = f"sqlite:///{db}"
    for command in ("status", "best"):
        result = _hpsearch_read_only(folder, command, "--study", "s", "--storage", url, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    status = _hpsearch_read_only(folder, "status", "--study", "s", "--json", "--storage", url, cwd=tmp_path)
    assert status.returncode == 0 and '"study": "s"' in status.stdout, status.stdout + status.stderr
    for command in ("reap", "worker"):
        line = _error_line(
            _hpsearch_read_only(folder, command, "--study", "s", "--storage", url, cwd=tmp_path), command
        )
        assert f"storage {url}: " in line and ("read-only" in line or "not writable" in line), line
        assert "make it writable (hpsearch status, best and dashboard read it as it is)" in line, line
    assert db.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["study.db"]


def test_the_dashboard_browses_a_study_in_a_read_only_folder(tmp_path: Path, spec_file: Path) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    db = _hpsearch_study(folder / "study.db", spec_file)
    before = db.read_bytes()
    with _read_only(folder) as cli:
        argv = [*cli, "dashboard", "--study", "s", "--storage", f"sqlite:///{db}", "--port", "0"]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=_cli_env(), stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            printed = [proc.stdout.readline() for _ in range(3)]
            assert "read-only" in printed[1], printed
            url = printed[2].split("open ", 1)[1].strip()
            base = url.split("/dashboard/")[0]
            with urllib.request.urlopen(f"{base}/api/studies", timeout=60) as response:
                assert b'"study_name": "s"' in response.read()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert db.read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["study.db"]


# -- 3. refused and read-only commands leave the storage as it was ----------------------------


def test_a_refused_start_leaves_a_plain_optuna_storage_untouched(storage_url: str, spec_file: Path) -> None:
    plain = optuna.create_study(study_name="plain", storage=urls.normalize(storage_url))  # psycopg2, as hpsearch
    plain.add_trial(optuna.trial.create_trial(value=1.0))
    tables = _tables(storage_url)
    path = urls.sqlite_path(urls.normalize(storage_url))
    before = path.read_bytes() if path else b""
    result = hpsearch(
        *("start", "--study", "plain", "--config", str(spec_file), "--storage", storage_url),
        *("--devices", "cpu:1", "--output-dir", str(spec_file.parent / "runs")),
        cwd=spec_file.parent,
    )
    assert "study 'plain' exists but was not created by hpsearch" in _error_line(result, "start")
    assert _tables(storage_url) == tables, "a refused start must not add tables"
    if path is not None:
        assert path.read_bytes() == before and _journal_mode(path) == "delete"
        assert not Path(f"{path}-wal").exists()


@pytest.mark.parametrize("command", ["status", "best", "reap", "worker", "dashboard"])
def test_refused_commands_leave_a_foreign_sqlite_file_untouched(tmp_path: Path, command: str) -> None:
    app = tmp_path / "app.db"
    conn = sqlite3.connect(app)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    before = app.read_bytes()
    result = hpsearch(command, "--study", "x", "--storage", f"sqlite:///{app}", cwd=tmp_path)
    assert "holds no studies" in _error_line(result, command)
    assert app.read_bytes() == before and _journal_mode(app) == "delete", "the journal mode is the file's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_reading_a_study_does_not_change_its_file(tmp_path: Path, spec_file: Path) -> None:
    db = _hpsearch_study(tmp_path / "study.db", spec_file)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=DELETE")  # as a copy made with another tool may be
    conn.close()
    before = db.read_bytes()
    for command in ("status", "best"):
        result = hpsearch(command, "--study", "s", "--storage", f"sqlite:///{db}", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert db.read_bytes() == before and _journal_mode(db) == "delete"


def test_a_study_that_goes_ahead_gets_wal_and_the_project_tables(tmp_path: Path, spec_file: Path) -> None:
    # A file that plain Optuna made (another study in it): hpsearch's study goes ahead beside it.
    db = tmp_path / "adopted.db"
    optuna.create_study(study_name="plain", storage=f"sqlite:///{db}")
    assert _journal_mode(db) == "delete"
    _hpsearch_study(db, spec_file)
    assert _journal_mode(db) == "wal"
    assert {"hpsearch_budget_slots", "hpsearch_workers"} <= _tables(f"sqlite:///{db}")
