"""Storage calls are repeated only where a repeat is safe: a lost answer to a call that creates a trial or a study,
claims a waiting trial or deletes a study (the commit went through, then the connection dropped) leaves what one
call leaves, on real SQLite and PostgreSQL. The fault is injected after the commit: the only mock here."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import tomllib
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from hpsearch.search.study import studies as study_mod
from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers import retry
from hpsearch.storage import attrs
from hpsearch.storage.open import Storage, open_storage
from hpsearch.storage.retrying import CREATED_AS, REPEATS
from tests.conftest import spec_text

LostReply = Callable[[Callable[[Session], bool]], dict[str, int]]


@pytest.fixture
def storage(storage_url: str) -> Iterator[Storage]:
    opened = open_storage(storage_url, create=True)
    opened.prepare()
    yield opened
    opened.close()


@pytest.fixture
def lose_reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[LostReply]:
    """``lose_reply(which)``: the next commit of a transaction whose writes ``which`` picks (judged as they are
    flushed) goes through, then raises the error a dropped connection gives, as if the answer was lost on the way
    back. Returns a counter of the faults."""
    listeners: list[Callable[..., None]] = []

    def arm(which: Callable[[Session], bool]) -> dict[str, int]:
        fired = {"n": 0}
        commit = Session.commit

        def judge(session: Session, *_: object) -> None:
            if fired["n"] == 0 and which(session):
                session.info["lose_reply"] = True

        def commit_then_lose(self: Session) -> None:
            commit(self)  # flushes what is left, judged then
            if self.info.pop("lose_reply", False):
                fired["n"] += 1
                raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

        sqlalchemy.event.listen(Session, "before_flush", judge)
        listeners.append(judge)
        monkeypatch.setattr(Session, "commit", commit_then_lose)
        return fired

    yield arm
    for judge in listeners:
        sqlalchemy.event.remove(Session, "before_flush", judge)


def _adds(model: type) -> Callable[[Session], bool]:
    return lambda s: any(isinstance(o, model) for o in s.new)


def test_every_storage_call_optuna_makes_is_named_with_why_a_repeat_is_safe() -> None:
    public = {
        name
        for base in (optuna.storages.BaseStorage, BaseHeartbeat)
        for name, _ in inspect.getmembers(base, inspect.isfunction)
        if not name.startswith("_")
    }
    # What optuna.load_study's cache calls on us, private methods included.
    cached = set(re.findall(r"self\._backend\.(\w+)", inspect.getsource(optuna.storages._cached_storage)))
    assert public | cached <= set(REPEATS), sorted((public | cached) - set(REPEATS))
    assert {"_create_new_trial", "_get_trials", "_set_trial_param"} <= cached  # the scan finds them


def test_a_lost_reply_to_create_new_trial_leaves_one_trial(storage: Storage, lose_reply: LostReply) -> None:
    study = optuna.create_study(study_name="s", storage=storage.optuna)
    fired = lose_reply(_adds(models.TrialModel))
    trial = study.ask()
    assert fired["n"] == 1, "the fault was injected"
    trials = study.get_trials()
    assert [t.number for t in trials] == [0], "a repeat made a second trial"
    assert trial.number == 0 and trials[0].state == TrialState.RUNNING
    study.tell(trial, 1.0)
    assert study.get_trials()[0].state == TrialState.COMPLETE


def test_a_lost_reply_to_a_queued_trial_leaves_one_queued(storage: Storage, lose_reply: LostReply) -> None:
    study = optuna.create_study(study_name="s", storage=storage.optuna)
    fired = lose_reply(_adds(models.TrialModel))
    study.enqueue_trial({"x": 1.0}, user_attrs={attrs.RETRY_OF: 7})
    assert fired["n"] == 1
    (queued,) = study.get_trials()
    assert queued.state == TrialState.WAITING and queued.user_attrs == {attrs.RETRY_OF: 7}
    assert CREATED_AS in queued.system_attrs


def test_a_lost_reply_to_a_claim_of_a_waiting_trial_gives_it_to_its_claimer(
    storage: Storage, lose_reply: LostReply
) -> None:
    study = optuna.create_study(study_name="s", storage=storage.optuna)
    study.enqueue_trial({}, user_attrs={attrs.RETRY_OF: 0})

    def claims(s: Session) -> bool:
        return any(isinstance(o, models.TrialModel) and o.state == TrialState.RUNNING for o in s.dirty)

    fired = lose_reply(claims)
    trial = retry.pop_retry(storage.optuna, study)
    assert fired["n"] == 1
    # Optuna answers a repeated claim False: the retry was left running with nobody training it.
    assert trial is not None and trial.number == 0
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING]
    # A second claimer still loses: the claim has one winner.
    assert not storage.optuna.set_trial_state_values(study.get_trials()[0]._trial_id, TrialState.RUNNING)


def test_a_lost_reply_to_create_new_study_creates_it_once(
    storage: Storage, lose_reply: LostReply, tmp_path: Path
) -> None:
    where = Path("/nonexistent")
    spec = StudySpec.from_dict(
        tomllib.loads(spec_text(where / "model", where / "t.jsonl", where / "d.jsonl")), base_dir=where
    )
    fired = lose_reply(_adds(models.StudyModel))
    # Before: the repeat found the study its first attempt made, and `start` said it was not made by hpsearch.
    study = study_mod.create_or_resume(storage, "made", spec)
    assert fired["n"] == 1
    assert [s.study_name for s in storage.optuna.get_all_studies()] == ["made"]
    assert attrs.SPEC in study.user_attrs


def test_a_study_someone_else_made_is_not_taken_for_a_lost_reply(storage: Storage) -> None:
    # A first attempt that finds the name taken is refused as before, whatever the study holds.
    optuna.create_study(study_name="theirs", storage=storage.optuna)
    with pytest.raises(optuna.exceptions.DuplicatedStudyError):
        storage.optuna.create_new_study([optuna.study.StudyDirection.MINIMIZE], "theirs")


def test_a_study_without_a_name_is_created_once(storage: Storage, lose_reply: LostReply) -> None:
    fired = lose_reply(_adds(models.StudyModel))
    storage.optuna.create_new_study([optuna.study.StudyDirection.MINIMIZE])
    assert fired["n"] == 1
    assert len(storage.optuna.get_all_studies()) == 1


def test_a_lost_reply_to_delete_study_deletes_it(storage: Storage, lose_reply: LostReply) -> None:
    optuna.create_study(study_name="gone", storage=storage.optuna)
    fired = lose_reply(lambda s: any(isinstance(o, models.StudyModel) for o in s.deleted))
    optuna.delete_study(study_name="gone", storage=storage.optuna)
    assert fired["n"] == 1
    assert storage.optuna.get_all_studies() == []
    with pytest.raises(KeyError):
        storage.optuna.delete_study(12345)  # a first attempt that finds no study still says so
