"""Issue 54: what the newer features read is input too. A URL's password in any form the driver reads is never
stored, printed or shown; an earlier study's rows, edited with plain SQL, are left out a line each (escaped); a
stored spec a database writer broke leaves the reading commands working and a finished `start` its summary."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.search.study import warm_start
from hpsearch.search.study.spec import load_file
from hpsearch.storage import urls
from hpsearch.storage.shown import shown
from tests.conftest import Cli, hpsearch, spec_text, start_study

SECRET = "S3cretPW"
# Every form in which a URL hands psycopg2/libpq a password: user info, the option, its percent-encoded key, the
# SSL key's password, a conninfo in ?dsn=, a second option after others.
SECRET_URLS = [
    f"postgresql://u:{SECRET}@h/db",
    f"postgresql://u@h/db?password={SECRET}",
    f"postgresql://u@h/db?%70assword={SECRET}",
    f"postgresql://u@h/db?%70%61ssword={SECRET}",
    f"postgresql://u@h/db?sslmode=require&sslpassword={SECRET}",
    f"postgresql://u@h/db?connect_timeout=3&PASSWORD={SECRET}",
    f"postgresql://u@h/db?dsn=host%3Dh%20password%3D{SECRET}",
    f"postgresql://u@h/db?application_name=x&password=%27{SECRET}%27",
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_every_password_form_is_found_and_masked(url: str) -> None:
    assert urls.secrets(url), f"{url}: no password found"
    assert SECRET not in urls.mask(url), urls.mask(url)
    assert not urls.secrets("postgresql://u@h/db?sslmode=require&passfile=/home/u/.pgpass")
    # A libpq conninfo string is no URL; its password is still not printed in the "not a URL" line.
    assert SECRET not in urls.mask(f"host=h dbname=x password={SECRET}")
    assert SECRET not in urls.mask(f"host=h password='{SECRET} x'")


def _spec(tmp_path: Path, tiny_model: Path, files: tuple[Path, Path], search: str = "", n_trials: int = 2) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(spec_text(tiny_model, *files, n_trials=n_trials, search=search))
    return path


@pytest.mark.parametrize("url", SECRET_URLS[1:])
def test_a_warm_start_url_holding_a_password_is_refused_and_nothing_is_stored(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files, search=f"warm_start = {json.dumps(url + '#small')}")
    db = tmp_path / "study.db"
    argv = ("start", "--study", "big", "--config", str(spec), "--storage", f"sqlite:///{db}", "--devices", "cpu:1")
    result = cli(*argv, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("hpsearch start: error: search.warm_start: ") and "holds a password" in line, line
    assert SECRET not in result.stderr + result.stdout
    assert not db.exists(), "a refused spec stores nothing"


def test_a_storage_password_in_an_option_reaches_no_stored_attribute_and_no_log(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    """The server trusts local connections, so the password given as ?password= is sent and ignored: the study
    runs, and neither its stored spec, the dashboard's "spec: ..." attributes nor any line printed holds it."""
    url = f"{pg_url}?password={SECRET}&connect_timeout=10"
    earlier = optuna.create_study(study_name="small", storage=urls.normalize(pg_url))
    earlier.add_trial(
        optuna.trial.create_trial(
            params={"learning_rate": 1e-3},
            distributions={"learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-2, log=True)},
            value=0.5,
        )
    )
    spec = _spec(tmp_path, tiny_model, demo_files, search='warm_start = "small"', n_trials=1)
    run = start_study("s", spec, url, tmp_path)
    status = hpsearch("status", "--study", "s", "--storage", url, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    printed = run.stdout + run.stderr + status.stdout + status.stderr
    assert "password=***" in printed and SECRET not in printed
    stored = optuna.load_study(study_name="s", storage=urls.normalize(pg_url))
    assert "spec: search" in stored.user_attrs
    assert SECRET not in json.dumps(stored.user_attrs) + json.dumps([t.user_attrs for t in stored.trials])


# -- an earlier study read by a warm start ---------------------------------------------------------------------

FORGED = "lr\n12:00:00 [start] INFO forged line\x1b[31m"


def _earlier(db: Path) -> str:
    url = f"sqlite:///{db}"
    study = optuna.create_study(study_name="small", storage=url)
    lr = optuna.distributions.FloatDistribution(1e-5, 1e-2, log=True)
    for value, rate in ((0.3, 1e-4), (0.2, 3e-4), (0.4, 1e-3), (0.5, 2e-4), (0.6, 5e-4)):
        params, distributions = {"learning_rate": rate}, {"learning_rate": lr}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=value))
    study.set_user_attr("hpsearch_spec", {"train": {"weight_decay": "NaN"}})
    return url


def test_an_earlier_studys_hand_written_rows_are_left_out_one_line_each_and_escaped(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    url = _earlier(tmp_path / "early.db")
    with sqlite3.connect(tmp_path / "early.db") as con:
        con.execute("UPDATE trial_values SET value = 'NaN' WHERE trial_id = 1")  # text where a number goes
        con.execute("UPDATE trial_params SET param_name = ? WHERE trial_id = 3", (FORGED,))
        # Rows Optuna's own reader fails on: JSON that is not, an enum value it does not know.
        con.execute("UPDATE trial_params SET distribution_json = '{bad' WHERE trial_id = 4")
    space = 'learning_rate = { type = "float", low = 5e-5, high = 2e-3, log = true }'
    path = tmp_path / "big.toml"
    path.write_text(spec_text(tiny_model, *demo_files, n_trials=9, space=space, search=f'warm_start = "{url}#small"'))
    plan = warm_start.plan(load_file(path), "big", f"sqlite:///{tmp_path / 'big.db'}")
    assert plan is not None
    # Trials 0 ('NaN'), 2 (its name forged) and 3 (unreadable) give nothing; 1 and 4 are whole.
    assert sorted(n for _, n in plan.queue) == [1, 4] and plan.finished == 3, plan
    text = "\n".join(plan.lines)
    assert len(plan.lines) == 3, plan.lines  # the NaN value; the unreadable row; the forged name
    assert "value not a finite number: 0 (NaN)" in text and "unreadable: 3 (JSONDecodeError" in text, text
    assert "\x1b" not in text and "\n12:00" not in text and shown(FORGED) in text, text


def test_a_warm_start_from_a_file_that_is_not_a_database_names_that_file(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    """Not the user's own healthy --storage file: the earlier study's."""
    mine = tmp_path / "mine.db"
    optuna.create_study(study_name="other", storage=f"sqlite:///{mine}")
    fake = tmp_path / "fake.db"
    fake.write_bytes(b"SQLite format 3\0" + b"garbage" * 2000)
    for source in ("/etc/passwd", str(fake)):
        spec = _spec(tmp_path, tiny_model, demo_files, search=f'warm_start = "sqlite:///{source}#x"')
        argv = ("start", "--study", "big", "--config", str(spec), "--storage", f"sqlite:///{mine}")
        result = cli(*argv, "--devices", "cpu:1", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert f"search.warm_start: storage sqlite:///{source}" in line and str(mine) not in line, line
        assert "not a database" in line


# -- a stored spec a database writer broke -------------------------------------------------------------------


def _break_stored_spec(db: Path, study: str, **search: object) -> None:
    """Plain SQL, as any writer with access to the database can."""
    with sqlite3.connect(db) as con:
        (study_id,) = con.execute("SELECT study_id FROM studies WHERE study_name = ?", (study,)).fetchone()
        where = "study_id = ? AND key = 'hpsearch_spec'"
        (text,) = con.execute(f"SELECT value_json FROM study_user_attributes WHERE {where}", (study_id,)).fetchone()
        spec = json.loads(text)
        spec["search"].update(search)
        con.execute(f"UPDATE study_user_attributes SET value_json = ? WHERE {where}", (json.dumps(spec), study_id))


def test_a_damaged_stored_spec_leaves_status_best_export_and_reap_reading_and_start_shows_its_summary(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    db = tmp_path / "study.db"
    url = f"sqlite:///{db}"
    spec = _spec(tmp_path, tiny_model, demo_files, search="price_per_gpu_hour = 2.0\ncurrency = 'EUR'")
    start_study("s", spec, url, tmp_path)
    _break_stored_spec(db, "s", currency="\x1b[2J\x1b[31mEUR", max_retries="many")
    with sqlite3.connect(db) as con:  # and a parameter's name, printed by status and best
        con.execute("UPDATE trial_params SET param_name = ?", (FORGED,))
    warning = "warning: study 's': its stored spec fails its checks (search."

    def read(*argv: str, code: int = 0) -> str:
        result = cli(*argv, "--study", "s", "--storage", url, cwd=tmp_path)
        assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
        assert "\x1b" not in result.stdout + result.stderr
        return result.stdout + result.stderr

    status = read("status")
    assert warning in status and "trials: 2/2 finished" in status, status
    assert shown(FORGED) in status and "\n12:00:00" not in status, status
    assert "EUR" not in status.replace("\\x1b[31mEUR", ""), "the damaged currency is not shown as money"
    assert json.loads(read("status", "--json").split("\nhpsearch status:")[0])["finished"] == 2
    best = read("best")
    assert warning in best and "best: trial " in best, best
    export = read("best", "--export", str(tmp_path / "export"))
    assert (tmp_path / "export" / "config.json").is_file(), export
    assert "no stale trials" in read("reap")
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, "nothing was lost or changed"

    # `start` runs nothing on it, in one line; the search it had finished is shown above that line.
    for config in ((), ("--config", str(spec))):
        result = cli("start", "--study", "s", *config, "--storage", url, "--devices", "cpu:1", cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("hpsearch start: error: study 's': its stored spec fails its checks"), line
        assert "trials: 2/2 finished" in result.stdout and "best: trial " in result.stdout, result.stdout


def test_an_export_refused_for_another_studys_folder_names_that_study(tmp_path: Path) -> None:
    """Study a's row points at trial-0/best of study b's folder: the refusal names b, whose model it is."""
    from hpsearch.search.views.export import ExportError, export_best
    from hpsearch.storage import rundir

    folder = tmp_path / "runs" / "b"
    (folder / "trial-0" / "best").mkdir(parents=True)
    rundir.claim(folder, "b\x1b[2J", "uid-of-b", "sqlite:///b.db")
    best = {"number": 0, "best_checkpoint": str(folder / "trial-0" / "best")}
    with pytest.raises(ExportError) as refused:
        export_best(best, "a", tmp_path / "out", "uid-of-a")
    said = str(refused.value)
    assert "is in the folder of study 'b\\x1b[2J' (from sqlite:///b.db), not of study 'a'" in said, said
    assert not (tmp_path / "out").exists()


def test_a_marker_and_study_names_read_back_are_printed_escaped_and_bounded(tmp_path: Path, storage_url: str) -> None:
    """A runs folder's marker and a storage's study names are rows others wrote: the refusals that quote them print
    them on one line, escape sequences written out, a long name cut."""
    import json

    import optuna

    from hpsearch.storage import rundir
    from hpsearch.storage.errors import StudyFolderError, StudyNotFoundError
    from hpsearch.storage.open import open_storage, require_study

    folder = tmp_path / "runs" / "s"
    folder.mkdir(parents=True)
    marker = {"uid": "other", "study": "s", "storage": "sqlite:///x.db\n\x1b[2Jforged line" + "x" * 5000}
    (folder / rundir.MARKER).write_text(json.dumps(marker))
    with pytest.raises(StudyFolderError) as taken:
        rundir.check(folder, "s", "mine", exists=True, storage="sqlite:///mine.db")
    said = str(taken.value)
    assert "\n" not in said and "\x1b" not in said and "\\x1b[2Jforged" in said and len(said) < 800, said

    storage = open_storage(storage_url, create=True)
    try:
        for name in ["evil\x1b]0;pwned\x07", "y" * 300]:
            optuna.create_study(study_name=name, storage=storage.optuna)
        with pytest.raises(StudyNotFoundError) as missing:
            require_study(storage, "ghost\x1b[2J")
    finally:
        storage.close()
    said = str(missing.value)
    assert "\x1b" not in said and "\x07" not in said and "evil\\x1b]0;pwned\\x07" in said, said
    assert "ghost\\x1b[2J" in said and "y" * 300 not in said, said
