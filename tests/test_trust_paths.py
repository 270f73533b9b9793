"""A study's rows and a shared runs folder are input: what they name is never deleted, moved,
loaded or unpickled unless it really lies inside a trial folder hpsearch made.

Each attack is played as someone who can only write the database (the dashboard's visitors,
a database user) or a shared runs folder would play it, against the real PostgreSQL.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
import torch

from hpsearch.storage import mounts, retention, urls
from hpsearch.storage.open import open_storage
from hpsearch.storage.trialdir import TrialDir
from tests.conftest import hpsearch, spec_text
from tests.support import deleted


class _Exploit:
    """Unpickling this runs a shell command: what a crafted state.pt or token cache would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _victim(tmp_path: Path) -> Path:
    """A folder of the user's that no trial wrote: it must survive everything below."""
    victim = tmp_path / "victim" / "precious"
    (victim / "best").mkdir(parents=True)
    (victim / "best" / "config.json").write_text("{}")
    (victim / "resume").mkdir()
    (victim / "resume" / "state.pt").write_bytes(b"not ours")
    (victim / "data.txt").write_text("keep me")
    return victim


def _start(tmp: Path, spec: Path, url: str, *extra: str) -> None:
    result = hpsearch(
        *("start", "--study", "s", "--config", str(spec), "--storage", url, "--devices", "cpu:1"),
        *("--output-dir", str(tmp / "runs"), *extra),
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _spec(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], n_trials: int, search: str = "") -> Path:
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, *demo_files, n_trials=n_trials, search=search).replace(
        'pruner = "median"', 'pruner = "none"'
    )
    spec.write_text(text)
    return spec


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(urls.normalize(url))


def test_retention_deletes_no_folder_a_row_names_and_the_sweep_follows_no_link(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files, n_trials=2, search="keep_top_k = 1")
    _start(tmp_path, spec, pg_url)
    runs = tmp_path / "runs" / "s"
    study = optuna.load_study(study_name="s", storage=urls.normalize(pg_url))
    [kept] = [t.number for t in study.get_trials() if deleted.why(study, t.number) is None]
    dropped = 1 - kept
    victim, victim2 = _victim(tmp_path / "a"), _victim(tmp_path / "b")
    # A database writer points the kept trial's checkpoint at the victim and makes it the
    # worst trial: the next retention drops it from the top 1.
    engine = _engine(pg_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE trial_user_attributes SET value_json = :v WHERE key = 'best_checkpoint' AND trial_id = "
                "(SELECT trial_id FROM trials WHERE number = :n)"
            ),
            {"v": json.dumps(str(victim / "best")), "n": kept},
        )
        conn.execute(
            sa.text(
                "UPDATE trial_values SET value = 1e9 WHERE trial_id = (SELECT trial_id FROM trials WHERE number = :n)"
            ),
            {"n": kept},
        )
    engine.dispose()
    # A shared-folder writer puts a link where the other finished trial's folder was: the sweep
    # at worker start would delete the resumable state "inside" it.
    (runs / f"trial-{dropped}").rename(tmp_path / "moved-away")
    (runs / f"trial-{dropped}").symlink_to(victim2, target_is_directory=True)
    _start(tmp_path, spec, pg_url, "--n-trials", "3")

    for v in (victim, victim2):
        assert (v / "best" / "config.json").exists(), "a folder outside every trial folder was deleted"
        assert (v / "resume" / "state.pt").exists() and (v / "data.txt").read_text() == "keep me"
    # The kept trial's own checkpoint is the one that went, and its row says so.
    assert not (runs / f"trial-{kept}" / "best").exists()
    study = optuna.load_study(study_name="s", storage=urls.normalize(pg_url))
    assert len(study.trials) == 3 and deleted.why(study, kept) == "not in the study's top 1"


def test_a_retry_moves_and_unpickles_nothing_a_row_names(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files, n_trials=1)
    _start(tmp_path, spec, pg_url)
    victim = _victim(tmp_path)
    pwned = tmp_path / "pwned"
    torch.save({"model": _Exploit(pwned)}, victim / "resume" / "state.pt")
    # A database writer queues a "retry" of trial 0 that resumes from the victim's folder.
    study = optuna.load_study(study_name="s", storage=urls.normalize(pg_url))
    study.enqueue_trial(
        {"learning_rate": 1e-3},
        user_attrs={"retry_of": 0, "retry_count": 1, "resume_from": str(victim / "resume" / "state.pt")},
        skip_if_exists=False,
    )
    _start(tmp_path, spec, pg_url, "--n-trials", "2")

    assert not pwned.exists(), "a crafted state.pt ran code"
    assert (victim / "best" / "config.json").exists(), "the victim's folder was moved into the retry's"
    assert (victim / "resume" / "state.pt").exists() and (victim / "data.txt").exists()
    trials = optuna.load_study(study_name="s", storage=urls.normalize(pg_url)).get_trials()
    assert trials[1].state == optuna.trial.TrialState.COMPLETE
    assert "resumed_from_step" not in trials[1].user_attrs, trials[1].user_attrs


def test_a_crafted_resumable_state_in_the_trial_s_own_folder_does_not_run(tmp_path: Path) -> None:
    from hpsearch.trainer.checkpoint import load_resume

    pwned = tmp_path / "pwned"
    state = tmp_path / "state.pt"
    torch.save({"model": {}, "step": 3, "payload": _Exploit(pwned)}, state)
    with pytest.raises(pickle.UnpicklingError):
        load_resume(state)
    assert not pwned.exists()


def test_the_token_cache_is_arrow_and_json_and_a_planted_pickle_runs_nothing(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    import pyarrow as pa
    from transformers import AutoTokenizer

    from hpsearch.trainer import encoding as dataset
    from hpsearch.trainer.config import DataConfig

    cfg = DataConfig(train=str(demo_files[0]), validation=str(demo_files[1]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cache = tmp_path / "cache"
    first = dataset.prepare(cfg, tokenizer, 32, cache)
    [meta] = cache.glob("tokens-*/meta.json")
    assert json.loads(meta.read_text())["splits"]["train"]["rows"] == len(first.train)
    with pa.ipc.open_file(meta.parent / "train.arrow") as f:
        assert f.read_all()["input_ids"].to_pylist() == list(first.train.input_ids)
    again = dataset.prepare(cfg, tokenizer, 32, cache)
    assert again.train.input_ids == first.train.input_ids and again.labels == first.labels
    # Someone with write access to a shared cache folder replaces the files with pickles.
    pwned = tmp_path / "pwned"
    for name in ("meta.json", "train.arrow"):
        (meta.parent / name).write_bytes(pickle.dumps(_Exploit(pwned)))
        third = dataset.prepare(cfg, tokenizer, 32, cache)
        assert not pwned.exists()
        assert third.train.input_ids == first.train.input_ids


def test_export_reads_only_trial_n_best_of_a_study_folder_and_follows_no_link(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files, n_trials=1)
    _start(tmp_path, spec, pg_url)
    best = tmp_path / "runs" / "s" / "trial-0" / "best"
    secret = tmp_path / "secret.txt"
    secret.write_text("ssh key")

    def export(target: str) -> str:
        out = hpsearch("best", "--study", "s", "--storage", pg_url, "--export", str(tmp_path / target), cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / target).exists()
        return out.stderr

    (best / "notes.txt").symlink_to(secret)
    assert "symbolic link" in export("e1")
    (best / "notes.txt").unlink()
    # A row names a model folder of the attacker's choosing (a copy of the real one).
    planted = tmp_path / "elsewhere" / "best"
    planted.parent.mkdir()
    os.system(f"cp -r {best} {planted}")
    engine = _engine(pg_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE trial_user_attributes SET value_json = :v WHERE key = 'best_checkpoint'"),
            {"v": json.dumps(str(planted))},
        )
    engine.dispose()
    assert "refusing to read it" in export("e2")


def test_retention_waits_for_an_export_that_is_copying(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    storage = open_storage(url, create=True)
    study = optuna.create_study(study_name="s", storage=storage.optuna)
    root = tmp_path / "runs" / "s"
    folders = [TrialDir(root, n) for n in range(2)]
    for n, f in enumerate(folders):
        f.make()
        f.best.mkdir()
        (f.best / "config.json").write_text("{}")
        study.add_trial(optuna.trial.create_trial(value=float(n), user_attrs={"best_checkpoint": str(f.best)}))
    candidates = [retention.candidate(t._trial_id, t.number, float(t.number), root, {}) for t in study.trials]
    with folders[1].reading():  # `best --export` is copying trial 1, which a better trial pushes out
        assert retention.retain(storage.optuna, "s", candidates, keep_top_k=1, minimize=True) == []
        assert folders[1].best.is_dir() and deleted.why(study, 1) is None
    [gone] = retention.retain(storage.optuna, "s", candidates, keep_top_k=1, minimize=True)
    assert gone.candidate.number == 1 and not folders[1].best.exists()
    assert folders[0].best.is_dir() and deleted.why(study, 1) == "not in the study's top 1"
    storage.close()


def test_a_password_given_as_an_option_is_never_printed_nor_written(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], pg_url: str
) -> None:
    secret = "hunter2-in-the-url"
    url = f"{pg_url}?password={secret}&sslpassword={secret}x"  # trust auth: the server ignores it
    spec = _spec(tmp_path, tiny_model, demo_files, n_trials=1)
    started = hpsearch(
        *("--verbose", "start", "--study", "s", "--config", str(spec), "--storage", url, "--devices", "cpu:1"),
        *("--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    status = hpsearch("status", "--study", "s", "--storage", url, cwd=tmp_path)
    missing = hpsearch("status", "--study", "nope", "--storage", url, cwd=tmp_path)
    bad = hpsearch(
        "status", "--study", "s", "--storage", url.replace("postgresql://", "postgresql:/x@y@"), cwd=tmp_path
    )
    printed = "".join(r.stdout + r.stderr for r in (started, status, missing, bad))
    assert "***" in printed
    assert secret not in printed
    for path in (tmp_path / "runs").rglob("*"):
        if path.is_file() and path.stat().st_size < 10_000_000:
            assert secret.encode() not in path.read_bytes(), path
    assert urls.mask(url).count("***") == 2


def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    from hpsearch.trainer import distributed

    store = distributed.main_store(2)
    port = f"{store.port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port}"):  # 0A: LISTEN
                listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing on any other address
    del store


def test_a_sqlite_file_on_a_network_file_system_is_recognised(tmp_path: Path) -> None:
    table = (
        "overlay / overlay rw 0 0\n"
        "autodl-fs /root/autodl-fs fuse.juicefs rw 0 0\n"
        "srv:/export /mnt/nfs nfs4 rw 0 0\n"
        "/dev/sda1 /root/autodl-tmp ext4 rw 0 0\n"
    )
    assert mounts.filesystem(Path("/root/autodl-fs/runs"), table) == "fuse.juicefs"
    assert mounts.filesystem(Path("/mnt/nfs/a/b"), table) == "nfs4"
    assert mounts.filesystem(Path("/root/autodl-tmp/x"), table) == "ext4"
    assert mounts.filesystem(Path("/root/autodl-fsx"), table) == "overlay"
    assert [mounts.is_network(k) for k in ("fuse.juicefs", "nfs4", "ext4", "overlay", "tmpfs")] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert not mounts.is_network(mounts.filesystem(tmp_path))  # this machine's own disk


def test_a_sqlite_file_on_a_network_file_system_is_warned_of_and_kept_out_of_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    # The fault injected: this folder reports itself as AutoDL's autodl-fs (a JuiceFS FUSE mount).
    monkeypatch.setattr(mounts, "filesystem", lambda path, table=None: "fuse.juicefs")
    db = tmp_path / "study.db"
    with caplog.at_level("WARNING"):
        open_storage(f"sqlite:///{db}", create=True).close()
    assert "network file system (fuse.juicefs)" in caplog.text
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] != "wal"


def test_a_study_folder_swapped_for_a_link_after_the_check_stops_the_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention checks that a trial's `best` lies in the runs folder, then deletes it. A study folder swapped for a
    link to another tree in between (the check passed on the real folder) must not take the deletion there: every
    folder on the way is opened without following links."""
    from hpsearch.storage import regular
    from hpsearch.storage.trialdir import TrialDir

    root = tmp_path / "runs" / "s"
    folder = TrialDir(root, 0)
    folder.make()
    (folder.best).mkdir()
    (folder.best / "model.safetensors").write_bytes(b"w")
    victim = tmp_path / "elsewhere"
    (victim / "trial-0" / "best").mkdir(parents=True)
    (victim / "trial-0" / "best" / "precious").write_text("keep")

    def swapped_after_the_check(path: Path) -> bool:
        root.rename(tmp_path / "runs" / "s-moved")
        root.symlink_to(victim)  # the study folder is now a link to the victim's tree
        return True

    monkeypatch.setattr(TrialDir, "holds", lambda self, path: swapped_after_the_check(path))
    folder.remove(folder.best)
    assert (victim / "trial-0" / "best" / "precious").read_text() == "keep"
    # Without a link on the way, it deletes: a file, and a folder with a link inside (unlinked, not followed).
    real = tmp_path / "runs" / "s-moved" / "trial-0" / "best"
    (real / "outside").symlink_to(victim)
    assert regular.remove(real) and not real.exists() and (victim / "trial-0" / "best" / "precious").exists()
    (tmp_path / "f").write_text("x")
    assert regular.remove(tmp_path / "f") and not (tmp_path / "f").exists()
    assert not regular.remove(tmp_path / "f")
