"""Study-wide checkpoint retention: top-k best checkpoints stay, the rest go, and `best --export`."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpsearch.storage import deletions
from hpsearch.storage.retention import Candidate, disk_bytes, plan
from tests.conftest import hpsearch, spec_text


def c(number: int, value: float) -> Candidate:
    return Candidate(trial_id=100 + number, number=number, value=value, path=Path(f"/runs/trial-{number}/best"))


def test_plan_keeps_the_top_k_by_direction() -> None:
    trials = [c(0, 0.5), c(1, 0.2), c(2, 0.9), c(3, 0.4)]
    assert sorted(d.candidate.number for d in plan(trials, keep_top_k=2, minimize=True)) == [0, 2]
    assert sorted(d.candidate.number for d in plan(trials, keep_top_k=2, minimize=False)) == [1, 3]
    assert plan(trials, keep_top_k=4, minimize=True) == []


def test_plan_respects_the_disk_cap_but_never_deletes_the_best() -> None:
    trials = [c(0, 0.1), c(1, 0.2), c(2, 0.3)]
    sizes = {t.path: 400 for t in trials}
    deleted = plan(trials, keep_top_k=3, minimize=True, max_disk_bytes=900, sizes=sizes)
    assert [d.candidate.number for d in deleted] == [2]
    assert "max_disk_gb" in deleted[0].reason
    # A cap smaller than one checkpoint still keeps the best one.
    deleted = plan(trials, keep_top_k=3, minimize=True, max_disk_bytes=1, sizes=sizes)
    assert [d.candidate.number for d in deleted] == [2, 1]


def test_search_keeps_only_top_k_checkpoints_and_exports_the_best(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], storage_url: str
) -> None:
    spec = tmp_path / "spec.toml"
    # No pruning: every trial completes and competes for the two kept checkpoints.
    spec.write_text(
        spec_text(tiny_model, *demo_files, n_trials=5, search="keep_top_k = 2").replace(
            'pruner = "median"', 'pruner = "none"'
        )
    )
    runs = tmp_path / "runs"
    result = hpsearch(
        "start",
        "--study",
        "keep",
        "--config",
        str(spec),
        "--storage",
        storage_url,
        "--devices",
        "cpu:1",
        "--output-dir",
        str(runs),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    url = storage_url.replace("postgresql://", "postgresql+psycopg2://")
    study = optuna.load_study(study_name="keep", storage=url)
    complete = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(complete) == 5
    ranked = sorted(complete, key=lambda t: t.value)  # metric = loss
    seen = {t.number: deletions.attributes(t, study.user_attrs) for t in complete}
    for t in complete:
        # Every trial's best_checkpoint stays the path of its own best folder, kept or not (issue 56)...
        folder = runs / "keep" / f"trial-{t.number}"
        assert Path(t.user_attrs["best_checkpoint"]) == (folder / "best").resolve(), t.user_attrs
        # ... and its resumable state, deleted as the trial completed, says so beside its path.
        assert Path(t.user_attrs["resume_checkpoint"]).parent == (folder / "resume").resolve()
        assert seen[t.number]["resume_checkpoint_deleted"] == "trial complete"
    for t in ranked[:2]:
        assert Path(t.user_attrs["best_checkpoint"]).is_dir()
        assert "best_checkpoint_deleted" not in seen[t.number]
    for t in ranked[2:]:
        assert seen[t.number]["best_checkpoint_deleted"] == "not in the study's top 2", seen[t.number]
        assert not Path(t.user_attrs["best_checkpoint"]).exists()
    # status shows every path, a deleted one with why; the Python API loads none of them.
    status = json.loads(hpsearch("status", "--study", "keep", "--storage", storage_url, "--json", cwd=tmp_path).stdout)
    shown = {t["number"]: t for t in status["trials"]}
    for t in complete:
        assert shown[t.number]["best_checkpoint"] == t.user_attrs["best_checkpoint"]
        assert shown[t.number]["best_checkpoint_deleted"] == seen[t.number].get("best_checkpoint_deleted")
    import hpsearch as api

    frame = api.load("keep", storage_url).trials().set_index("number")
    for t in ranked[:2]:
        assert frame.loc[t.number, "checkpoint"] == Path(t.user_attrs["best_checkpoint"])
    for t in ranked[2:]:
        assert frame.loc[t.number, "checkpoint"] is None
        assert frame.loc[t.number, "checkpoint_deleted"] == "not in the study's top 2"
    # On disk: exactly the two best checkpoints, and no resumable state of finished trials.
    assert sorted(p.parent.name for p in (runs / "keep").glob("trial-*/best")) == sorted(
        f"trial-{t.number}" for t in ranked[:2]
    )
    assert not list((runs / "keep").glob("trial-*/resume"))
    for t in complete:
        assert t.user_attrs["device_seconds"] > 0

    export = tmp_path / "exported"
    out = hpsearch("best", "--study", "keep", "--storage", storage_url, "--export", str(export), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((export / "hpsearch_best.json").read_text())
    assert record["trial"] == ranked[0].number and record["value"] == pytest.approx(ranked[0].value)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export)
    assert model(**tok(["a fine film"], return_tensors="pt")).logits.shape == (1, 2)
    assert disk_bytes(export) > 0

    again = hpsearch("best", "--study", "keep", "--storage", storage_url, "--export", str(export), cwd=tmp_path)
    assert again.returncode == 2
    assert "exists and is not an empty folder" in again.stderr and "Traceback" not in again.stderr


def test_plan_breaks_a_tie_by_the_lower_loss() -> None:
    trials = [
        Candidate(100, 0, 0.8, Path("/runs/0"), loss=0.41),
        Candidate(101, 1, 0.8, Path("/runs/1"), loss=0.38),
        Candidate(102, 2, 0.7, Path("/runs/2"), loss=0.30),
        Candidate(103, 3, 0.8, Path("/runs/3")),  # no loss on record: last among its equals
    ]
    assert [d.candidate.number for d in plan(trials, keep_top_k=1, minimize=False)] == [0, 3, 2]


def test_equally_accurate_trials_rank_by_their_loss_for_retention_and_best(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    """The tiny model learns nothing in these few steps: every trial predicts the majority label,
    so their accuracies tie while their losses differ. The study keeps, and `best` names, the
    trial with the lowest loss among them, not the first."""
    spec = tmp_path / "spec.toml"
    text = spec_text(tiny_model, *demo_files, n_trials=3, search="keep_top_k = 1")
    spec.write_text(text.replace('pruner = "median"', 'pruner = "none"').replace('"loss"', '"accuracy"'))
    runs = tmp_path / "runs"
    args = ("--study", "tie", "--storage", sqlite_url)
    result = hpsearch(
        "start", *args, "--config", str(spec), "--devices", "cpu:1", "--output-dir", str(runs), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]

    complete = optuna.load_study(study_name="tie", storage=sqlite_url).get_trials(states=(TrialState.COMPLETE,))
    top = max(t.value for t in complete if t.value is not None)
    tied = [t for t in complete if t.value == top]
    winner = min(tied, key=lambda t: t.user_attrs["best_val_loss"])
    assert len(tied) > 1 and winner.number != min(t.number for t in tied), "the test needs a tie the first does not win"
    assert [p.parent.name for p in runs.glob("tie/trial-*/best")] == [f"trial-{winner.number}"]
    best = json.loads(hpsearch("best", *args, "--json", cwd=tmp_path).stdout)
    assert best["number"] == winner.number and best["best_checkpoint"] == winner.user_attrs["best_checkpoint"]
