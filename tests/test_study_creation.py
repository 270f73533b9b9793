"""Creating a study: one creator among racing `start`s, nothing left by a deleted namesake, no foreign study adopted.

The racers are real processes released together by a barrier, against SQLite and the real
PostgreSQL, calling what `hpsearch start` calls (``create_or_resume``).
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import optuna
from optuna.trial import TrialState

from hpsearch.search.study import studies
from hpsearch.search.study.spec import load_file
from hpsearch.storage import attrs, liveness, slots, urls
from hpsearch.storage.open import open_storage
from hpsearch.storage.tables import StudyCreation
from tests.conftest import Cli, hpsearch

ROUNDS = 4
ENQUEUED = "[[search.enqueue]]\nlearning_rate = 1e-3\n[[search.enqueue]]\nlearning_rate = 2e-3\n[search.space]"


def _racer(url: str, name: str, spec_path: str, barrier: multiprocessing.synchronize.Barrier) -> str:
    """One `start`'s creation: "ok", or the error it was refused with."""
    storage = open_storage(url, create=True)
    try:
        spec = load_file(Path(spec_path))
        barrier.wait(timeout=60)
        studies.create_or_resume(storage, name, spec)
        return "ok"
    except studies.SpecError as err:
        return f"refused: {err}"
    except Exception:
        return f"crashed: {traceback.format_exc()}"
    finally:
        storage.close()


def _races(url: str, specs: list[Path]) -> list[list[str]]:
    """ROUNDS races of ``specs``' starts on new studies race0, race1, ...: each round's outcomes."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(len(specs))  # cyclic: one per round
        with ctx.Pool(len(specs)) as pool:
            rounds = []
            for n in range(ROUNDS):
                results = [pool.apply_async(_racer, (url, f"race{n}", str(p), barrier)) for p in specs]
                rounds.append([r.get(timeout=120) for r in results])
            return rounds


def _with_enqueue(spec_file: Path, name: str, replace: tuple[str, str] = ("", "")) -> Path:
    text = spec_file.read_text().replace("[search.space]", ENQUEUED)
    path = spec_file.with_name(name)
    path.write_text(text.replace(*replace) if replace[0] else text)
    return path


def test_racing_starts_create_the_study_once_and_queue_its_enqueue_once(storage_url: str, spec_file: Path) -> None:
    spec = _with_enqueue(spec_file, "enqueue.toml")
    open_storage(storage_url, create=True).close()  # the schema first: its own race is test_schema_race's
    for n, outcomes in enumerate(_races(storage_url, [spec, spec])):
        assert outcomes == ["ok", "ok"], outcomes
        study = optuna.load_study(study_name=f"race{n}", storage=urls.normalize(storage_url))
        queued = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("enqueued")]
        assert sorted(t.system_attrs["fixed_params"]["learning_rate"] for t in queued) == [1e-3, 2e-3], (
            f"round {n}: queued twice"
        )
        assert study.user_attrs[attrs.SPEC] == load_file(spec).to_dict()


def test_of_racing_starts_with_different_specs_one_is_refused_with_the_difference(
    storage_url: str, spec_file: Path
) -> None:
    low = _with_enqueue(spec_file, "low.toml")
    high = _with_enqueue(spec_file, "high.toml", ("high = 3e-3", "high = 5e-3"))
    open_storage(storage_url, create=True).close()
    for n, outcomes in enumerate(_races(storage_url, [low, high])):
        name = f"race{n}"
        assert sorted(o.split(":")[0] for o in outcomes) == ["ok", "refused"], outcomes
        [refusal] = [o for o in outcomes if o.startswith("refused")]
        assert f"study {name!r} exists with a different spec (search.space.learning_rate.high: stored " in refusal, (
            refusal
        )
        assert "\n" not in refusal.strip()
        winner = low if outcomes[0] == "ok" else high
        study = optuna.load_study(study_name=name, storage=urls.normalize(storage_url))
        assert study.user_attrs[attrs.SPEC] == load_file(winner).to_dict(), "the creator's spec stays"
        assert len(study.get_trials(deepcopy=False)) == 2


def test_a_deleted_and_recreated_study_runs_its_trials(pg_url: str, spec_file: Path, tmp_path: Path) -> None:
    def start(root: Path) -> None:
        result = hpsearch(
            *("start", "--study", "s", "--config", str(spec_file), "--storage", pg_url),
            *("--devices", "cpu:1", "--output-dir", str(root / "runs")),
            cwd=tmp_path,
            env={"OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0, result.stderr[-3000:]

    start(tmp_path / "first")
    optuna.delete_study(study_name="s", storage=urls.normalize(pg_url))  # as optuna-dashboard's delete does
    start(tmp_path / "second")  # another folder: the first one is the deleted study's
    study = optuna.load_study(study_name="s", storage=urls.normalize(pg_url))
    done = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == load_file(spec_file).search.n_trials, "the deleted study's trial slots were counted"
    storage = open_storage(pg_url, create=False)
    try:
        assert slots.used_slots(storage.db, "s") == len(done)
        assert [w.state for w in liveness.list_workers(storage.db, "s")] == ["finished"], "one worker: this start's"
    finally:
        storage.close()


def test_an_empty_plain_optuna_study_is_refused(cli: Cli, storage_url: str, spec_file: Path) -> None:
    # The spec's metric is the loss: the same direction, empty, and still not adopted.
    direction = "minimize"
    optuna.create_study(study_name="plain", storage=urls.normalize(storage_url), direction=direction)
    result = cli(
        *("start", "--study", "plain", "--config", str(spec_file), "--storage", storage_url),
        *("--devices", "cpu:1", "--output-dir", str(spec_file.parent / "runs")),
        cwd=spec_file.parent,
    )
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"study 'plain' exists but was not created by hpsearch (0 trials, {direction}); choose another --study name"
        )
    ), result.stderr
    assert optuna.load_study(study_name="plain", storage=urls.normalize(storage_url)).user_attrs == {}, (
        "nothing written to it"
    )


def test_a_start_cut_short_while_creating_is_created_again(storage_url: str, spec_file: Path) -> None:
    spec = load_file(_with_enqueue(spec_file, "enqueue.toml"))
    storage = open_storage(storage_url, create=True)
    try:
        # What a `start` killed between Optuna's study and its spec leaves: the creation mark,
        # a spec-less study and part of the queue.
        storage.db.run(lambda s: s.add(StudyCreation(study_name="s", started_at=0.0)), what="mark")
        half = optuna.create_study(study_name="s", storage=storage.optuna, direction="minimize")
        half.enqueue_trial({"learning_rate": 1e-3}, user_attrs={"enqueued": True})
        assert studies.check_spec_before_create(storage, "s", spec) == (True, None), "neither new nor foreign"
        study = studies.create_or_resume(storage, "s", spec)
        assert len(study.get_trials(deepcopy=False)) == 2, "queued once, as a new study"
        assert study.user_attrs[attrs.SPEC] == spec.to_dict()
        assert storage.db.run(lambda s: s.get(StudyCreation, "s"), what="read") is None
    finally:
        storage.close()
