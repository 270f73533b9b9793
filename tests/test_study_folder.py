"""A study's checkpoint folder is its own: a second study of the same name cannot write over it.

Trial n of study S writes OUTPUT/S/trial-n, so without a check a study of the same name on another
storage (or one started again after its database was deleted) overwrote the first one's finished
checkpoints, and `best --export` of the first study then copied the second's model.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from tests.conftest import Cli, spec_text, start_study


def _spec(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> Path:
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text(tiny_model, *demo_files, n_trials=1, extra_train="max_steps = 5"))
    return spec


def _refused(result: object, study_dir: Path) -> None:
    stderr = result.stderr  # type: ignore[attr-defined]
    assert result.returncode == 2, stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert f"{study_dir} holds the checkpoints of another study named 's'" in stderr, stderr


def test_same_name_on_another_storage_is_refused(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], cli: Cli
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files)
    start_study("s", spec, f"sqlite:///{tmp_path / 'a.db'}", tmp_path)
    study_dir = tmp_path / "runs" / "s"
    before = {p: p.stat().st_mtime_ns for p in study_dir.rglob("*") if p.is_file()}

    other = tmp_path / "b.db"
    argv = ("--study", "s", "--storage", f"sqlite:///{other}", "--devices", "cpu:1", "--output-dir", "runs")
    _refused(cli("start", "--config", str(spec), *argv, cwd=tmp_path), study_dir)
    assert not other.exists(), "a refused start must not create the storage"

    # The database deleted and the study started again: the old checkpoints are not the new study's.
    (tmp_path / "a.db").rename(tmp_path / "a-old.db")
    again = cli("start", "--config", str(spec), *argv[:2], "--storage", f"sqlite:///{tmp_path / 'a.db'}",
                *argv[4:], cwd=tmp_path)  # fmt: skip
    _refused(again, study_dir)
    assert f"(from sqlite:///{tmp_path / 'a.db'}, since deleted or created again)" in again.stderr, again.stderr
    assert {p: p.stat().st_mtime_ns for p in study_dir.rglob("*") if p.is_file()} == before

    # A worker joining a same-named study elsewhere is refused the same way.
    optuna.copy_study(
        from_study_name="s", from_storage=f"sqlite:///{tmp_path / 'a-old.db'}", to_storage=f"sqlite:///{other}"
    )
    storage = optuna.storages.RDBStorage(f"sqlite:///{other}")
    storage.set_study_user_attr(storage.get_study_id_from_name("s"), "hpsearch_uid", "another-study")
    storage.engine.dispose()
    _refused(cli("worker", *argv, cwd=tmp_path), study_dir)


def test_resuming_the_same_study_uses_its_folder(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files)
    url = f"sqlite:///{tmp_path / 'a.db'}"
    start_study("s", spec, url, tmp_path)
    marker = json.loads((tmp_path / "runs" / "s" / ".hpsearch-study.json").read_text())
    stored = optuna.load_study(study_name="s", storage=url).user_attrs["hpsearch_uid"]
    assert marker["uid"] == stored and marker["study"] == "s"
    # From another working directory, as another terminal would.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    start_study("s", spec, url, tmp_path)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 1


def test_export_refuses_a_checkpoint_another_study_wrote(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], cli: Cli
) -> None:
    spec = _spec(tmp_path, tiny_model, demo_files)
    url = f"sqlite:///{tmp_path / 'a.db'}"
    start_study("s", spec, url, tmp_path)
    # What an older hpsearch, which did not check the folder, let another study do.
    marker = tmp_path / "runs" / "s" / ".hpsearch-study.json"
    marker.write_text(json.dumps({"uid": "other", "study": "s", "storage": "sqlite:///b.db"}))
    result = cli("best", "--study", "s", "--storage", url, "--export", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "was overwritten by another study named 's' (from sqlite:///b.db)" in result.stderr
    assert not (tmp_path / "out").exists()
