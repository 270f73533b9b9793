"""Optuna's RDB storage with retries: a database outage is waited out (``db.retrying``), not fatal to every
``trial.report`` and ``study.tell`` of trials that were training fine.

Only a call that is safe to repeat is repeated. A transient error can come after the commit went through (the
connection dropped before the answer came back), so a repeat must leave what one call leaves: ``REPEATS`` names every
call Optuna's storage interfaces and its cache (``_CachedStorage``, which ``optuna.load_study`` puts in front of us
and which calls some private methods) make, with why repeating it is safe. Reads and upserts are safe as they are;
the calls that create something (a trial, a study) or move a trial out of WAITING are made safe here with a check,
each described where it is done. A call not in the table (one a newer Optuna adds) is made once, never blindly
repeated."""

from __future__ import annotations

import copy
import functools
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import optuna
from optuna.exceptions import DuplicatedStudyError, StorageInternalError, UpdateFinishedTrialError
from optuna.storages._base import DEFAULT_STUDY_NAME_PREFIX
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from hpsearch.storage.db import DEFAULT_RETRY, RetryPolicy, is_transient, retrying

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

CREATED_AS = "hpsearch:created_as"
"""A trial's system attribute: an id drawn for the call that created it, written in the same transaction, so that a
repeat of a creation whose commit went through finds that trial instead of making a second one."""
CLAIMED_AS = "hpsearch:claimed_as"
"""A trial's system attribute: an id drawn for the call that moved it from WAITING to RUNNING, written in the same
transaction, so that a repeat of that claim knows it won (Optuna answers a second claim False)."""

READ = "a read"
UPSERT = "writes one value, replacing what a first attempt wrote"
REPEATS: dict[str, str] = {
    "get_all_studies": READ,
    "get_all_trials": READ,
    "get_best_trial": READ,
    "get_n_trials": READ,
    "get_study_directions": READ,
    "get_study_id_from_name": READ,
    "get_study_name_from_id": READ,
    "get_study_system_attrs": READ,
    "get_study_user_attrs": READ,
    "get_trial": READ,
    "get_trial_id_from_study_id_trial_number": READ,
    "get_trial_number_from_id": READ,
    "get_trial_param": READ,
    "get_trial_params": READ,
    "get_trial_system_attrs": READ,
    "get_trial_user_attrs": READ,
    "check_trial_is_updatable": READ,
    "get_heartbeat_interval": READ,
    "get_failed_trial_callback": READ,
    "get_heartbeat_stale_trial_callback": READ,
    "_get_trials": READ,
    "_get_best_trial_id": READ,
    "_get_stale_trial_ids": READ,
    "remove_session": "no database call",
    "set_study_system_attr": UPSERT,
    "set_study_user_attr": UPSERT,
    "set_trial_system_attr": UPSERT,
    "set_trial_user_attr": UPSERT,
    "set_trial_intermediate_value": UPSERT,
    "set_trial_param": UPSERT,
    "_set_trial_param": UPSERT,
    "record_heartbeat": UPSERT,
    "create_new_trial": "checked: _create_new_trial",
    "_create_new_trial": "checked: a repeat finds the trial its id (CREATED_AS) names, if the first one committed",
    "create_new_study": "checked: the name is drawn before the first attempt, and a repeat that finds the study it "
    "was creating (its directions, nothing in it) returns it",
    "delete_study": "checked: a repeat that finds the study gone has deleted it",
    "set_trial_state_values": "checked: a repeat of a finishing change finds the trial finished; a repeat of a "
    "WAITING to RUNNING claim finds its own id (CLAIMED_AS)",
}
"""Every storage call hpsearch's Optuna makes, with why a repeat of it is safe: only these are retried."""


def _transient(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, StorageInternalError) else exc
    return isinstance(cause, SQLAlchemyError) and is_transient(cause)


class RetryingRDBStorage(optuna.storages.RDBStorage):
    """An RDBStorage whose calls wait out transient database errors, each repeated only as ``REPEATS`` says."""

    retry_policy: RetryPolicy = DEFAULT_RETRY

    def _repeat(self, name: str, once: Callable[[int], T]) -> T:
        """``once(attempt)`` (1 = the first), again on transient errors as the policy allows."""
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            return once(tries)

        return retrying(attempt, policy=self.retry_policy, what=f"optuna {name}", transient=_transient)

    # -- creating a trial ---------------------------------------------------------------------------------------

    def _create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> FrozenTrial:
        # Optuna's own loop repeats the transaction too (up to 5 times on any StorageInternalError): the check is
        # inside it, in _get_prepared_new_trial, so that every repeat, Optuna's or ours, finds a committed first.
        tagged = _tagged(template_trial, uuid.uuid4().hex)
        create = super()._create_new_trial
        return self._repeat("create_new_trial", lambda tries: create(study_id, tagged))

    def _get_prepared_new_trial(
        self, study_id: int, template_trial: FrozenTrial | None, session: Session
    ) -> models.TrialModel:
        token = template_trial.system_attrs.get(CREATED_AS) if template_trial is not None else None
        if token is not None and (made := _trial_tagged(session, study_id, CREATED_AS, token)) is not None:
            log.info("trial %d was created by a call whose answer was lost: not creating it again", made.number)
            return made
        return super()._get_prepared_new_trial(study_id, template_trial, session)

    # -- creating and deleting a study --------------------------------------------------------------------------

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        # Optuna draws a missing name inside the transaction: a repeat would draw another, and make a second study.
        name = study_name or DEFAULT_STUDY_NAME_PREFIX + str(uuid.uuid4())
        create = super().create_new_study

        def once(tries: int) -> int:
            try:
                return create(directions, name)
            except DuplicatedStudyError:
                # Callers create a study under a creation lock (storage/open.py): on a repeat, the one found is the
                # first attempt's if it is as that attempt left it; else it is someone else's, and said so.
                if tries > 1 and (found := self._as_created(name, directions)) is not None:
                    log.info("study %s was created by a call whose answer was lost: not creating it again", name)
                    return found
                raise

        return self._repeat("create_new_study", once)

    def _as_created(self, name: str, directions: Sequence[StudyDirection]) -> int | None:
        """The id of study ``name`` if it is as ``create_new_study`` leaves one: these directions, no trial, no
        attribute; else None."""
        try:
            study_id = super().get_study_id_from_name(name)
        except KeyError:
            return None
        bare = not super().get_study_user_attrs(study_id) and not super().get_study_system_attrs(study_id)
        same = list(super().get_study_directions(study_id)) == list(directions)
        return study_id if bare and same and super().get_n_trials(study_id) == 0 else None

    def delete_study(self, study_id: int) -> None:
        delete = super().delete_study

        def once(tries: int) -> None:
            try:
                delete(study_id)
            except KeyError:
                if tries == 1:
                    raise  # not found by a first attempt: no such study

        self._repeat("delete_study", once)

    # -- a trial's state ----------------------------------------------------------------------------------------

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        if state == TrialState.RUNNING and values is None:
            token = uuid.uuid4().hex
            return self._repeat("set_trial_state_values", lambda tries: self._claim(trial_id, token, tries))
        change = super().set_trial_state_values

        def once(tries: int) -> bool:
            try:
                return change(trial_id, state, values)
            except UpdateFinishedTrialError:
                if tries > 1:
                    return True  # a repeat of a state change whose first attempt did commit has succeeded
                raise

        return self._repeat("set_trial_state_values", once)

    def _claim(self, trial_id: int, token: str, tries: int) -> bool:
        """Optuna's WAITING to RUNNING change (a worker taking a queued trial; of two, one wins), with the winner's
        ``token`` written in the same transaction: a repeat whose first attempt won finds its token and says so,
        where Optuna would answer False and leave the trial running with nobody training it."""
        try:
            with _create_scoped_session(self.scoped_session) as session:
                trial = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
                if tries > 1 and trial.state == TrialState.RUNNING:
                    won = _trial_tagged(session, None, CLAIMED_AS, token, trial_id=trial_id) is not None
                    if won:
                        log.info("trial %d was claimed by a call whose answer was lost", trial.number)
                    return won
                self.check_trial_is_updatable(trial_id, trial.state)
                if trial.state != TrialState.WAITING:
                    return False
                trial.state = TrialState.RUNNING
                trial.datetime_start = datetime.now()  # as Optuna's own change does
                self._set_trial_attr_without_commit(
                    session, models.TrialSystemAttributeModel, trial_id, CLAIMED_AS, token
                )
        except IntegrityError:  # as Optuna's own change: another claim wrote first
            return False
        return True


def _tagged(template: FrozenTrial | None, token: str) -> FrozenTrial:
    """``template`` (or, for none, the RUNNING trial Optuna makes without one) with ``token`` as ``CREATED_AS``."""
    if template is None:
        return FrozenTrial(
            number=-1,
            state=TrialState.RUNNING,
            value=None,
            values=None,
            datetime_start=datetime.now(),  # as Optuna's own creation without a template does
            datetime_complete=None,
            params={},
            distributions={},
            user_attrs={},
            system_attrs={CREATED_AS: token},
            intermediate_values={},
            trial_id=-1,
        )
    tagged = copy.deepcopy(template)
    tagged.system_attrs = {**template.system_attrs, CREATED_AS: token}
    return tagged


def _trial_tagged(
    session: Session, study_id: int | None, key: str, token: str, *, trial_id: int | None = None
) -> models.TrialModel | None:
    """The trial (of ``study_id``; with id ``trial_id``) whose system attribute ``key`` holds ``token``, or None."""
    attr, trial = models.TrialSystemAttributeModel, models.TrialModel
    query = (
        select(trial)
        .join(attr, attr.trial_id == trial.trial_id)
        .where(attr.key == key, attr.value_json == json.dumps(token))
    )
    if study_id is not None:
        query = query.where(trial.study_id == study_id)
    if trial_id is not None:
        query = query.where(trial.trial_id == trial_id)
    return session.scalars(query).first()


def _retrying(name: str, method: F) -> F:
    @functools.wraps(method)
    def call(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        return self._repeat(name, lambda tries: method(self, *args, **kwargs))

    return call  # type: ignore[return-value]


# The reads and upserts, as RDBStorage implements them; the checked calls are the methods above.
for _name, _why in REPEATS.items():
    if not _why.startswith("checked") and _why != "no database call":
        setattr(RetryingRDBStorage, _name, _retrying(_name, getattr(optuna.storages.RDBStorage, _name)))
