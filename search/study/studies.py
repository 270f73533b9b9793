"""Creating, resuming and loading studies: one process creates a study under a lock and stores its spec; a second
`start` resumes it or is refused with the difference. The budget is budget.py, the sampler and pruner sampling.py."""

from __future__ import annotations

import logging
import uuid
import warnings
from contextlib import suppress
from typing import Any, TypeVar

import optuna
import sqlalchemy
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from hpsearch.search.errors import SpecError
from hpsearch.search.study import warm_start
from hpsearch.search.study.search_config import SearchConfig
from hpsearch.search.study.space import Param
from hpsearch.search.study.spec import StudySpec, difference
from hpsearch.storage import attrs, registry, slots
from hpsearch.storage.open import Storage, require_study
from hpsearch.storage.shown import shown
from hpsearch.storage.tables import StudyCreation
from hpsearch.trainer.config import DataConfig, ModelConfig, TrainConfig, from_dict

log = logging.getLogger(__name__)


class SpecMismatchError(SpecError):
    """A study exists with another spec."""


class DamagedSpecError(SpecError):
    """A study's stored spec fails its checks: a database writer changed it (hpsearch stores only checked specs).
    Nothing runs on it; what only reads a study (status, best, reap) reads it through ``readable_spec``."""


def create_or_resume(storage: Storage, name: str, spec: StudySpec, warm: warm_start.Plan | None = None) -> optuna.Study:
    """Create the study with ``spec``, or resume the one made with the same spec, under the study's creation lock:
    of several `start`s at once exactly one creates it, the others find it whole (its spec stored) and resume it or
    are refused with the difference. ``warm`` (study/warm_start.py) is applied only by the one that creates it."""
    storage.prepare()  # our tables and WAL: only now that the study is going ahead
    with storage.creation_lock(name):
        try:
            study_id: int | None = storage.optuna.get_study_id_from_name(name)
        except KeyError:
            study_id = None
        if study_id is not None and attrs.SPEC not in storage.optuna.get_study_user_attrs(study_id):
            # No other hpsearch is inside its creation now: a spec-less study is foreign, or what
            # a `start` killed while creating it left (its creation row says so; never used).
            _refuse_foreign(storage, name, study_id, spec, outside_lock=False)
            log.info("study %s: a start was cut short while creating it; creating it again", name)
            optuna.delete_study(study_name=name, storage=storage.optuna)
            study_id = None
        return _create(storage, name, spec, warm) if study_id is None else _resume(storage, name, spec)


def _create(storage: Storage, name: str, spec: StudySpec, warm: warm_start.Plan | None) -> optuna.Study:
    def mark(s: Session) -> None:
        s.merge(StudyCreation(study_name=name, started_at=s.execute(select(storage.db.clock())).scalar_one()))

    storage.db.run(mark, what=f"mark study {name!r} as being created")
    try:
        study = optuna.create_study(study_name=name, storage=storage.optuna, directions=spec.directions)
    except optuna.exceptions.DuplicatedStudyError:
        # Plain Optuna (which knows nothing of our lock) made one of that name just now.
        _unmark(storage, name)
        raise SpecError(f"study {name!r} exists but was not created by hpsearch; choose another --study name") from None
    # Rows a deleted study of this name left in our tables would count as the new one's.
    n_slots, rows = slots.forget_study(storage.db, name), registry.forget_study(storage.db, name)
    if n_slots or rows:
        log.info("study %s: removed %d trial slots and %d worker rows of a deleted study", name, n_slots, rows)
    ensure_uid(study)
    # Known-good configurations run first: queued now, the first ask() of any worker gets one.
    for params in spec.enqueue:
        study.enqueue_trial(params, user_attrs={attrs.ENQUEUED: True})
    if warm is not None:  # here only: a resumed study or a second worker never applies it again
        warm_start.apply(study, spec, warm)
    _store_spec(storage, study, spec)  # last: a study with a spec is whole
    _unmark(storage, name)
    queued = len(spec.enqueue) + (len(warm.queue) if warm else 0)
    log.info("created study %s in %s (%d queued trials)", name, storage.display, queued)
    return study


def _unmark(storage: Storage, name: str) -> None:
    what = f"mark study {name!r} as created"
    storage.db.run(lambda s: s.execute(delete(StudyCreation).where(StudyCreation.study_name == name)), what=what)


def _resume(storage: Storage, name: str, spec: StudySpec) -> optuna.Study:
    study = optuna.load_study(study_name=name, storage=storage.optuna)
    check_same(name, checked_spec(name, study.user_attrs[attrs.SPEC]), spec)
    trials = warm_start.ran_here(study.get_trials(deepcopy=False))
    log.info("resuming study %s (%d trials so far)", name, len(trials))
    # Said up front; the workers still start, since a crashed host's claimed trials are theirs.
    states = optuna.trial.TrialState
    done = sum(t.state in (states.COMPLETE, states.PRUNED) for t in trials)
    if done >= spec.search.n_trials:
        log.warning(
            "study %s already has %d finished trials and n_trials = %d: no new trial will start; "
            "pass --n-trials N (or raise search.n_trials) to search further",
            name,
            done,
            spec.search.n_trials,
        )
    ensure_uid(study)
    _store_spec(storage, study, spec)
    return study


def _store_spec(storage: Storage, study: optuna.Study, spec: StudySpec) -> None:
    with warnings.catch_warnings():  # experimental in Optuna 4, and the dashboard's axes read it
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(spec.metric_names)  # else every chart says "Objective 0"
    # Before the spec's JSON: the dashboard lists a new study's attributes in this order.
    for key, text in spec.readable().items():
        study.set_user_attr(key, text)
    # Stored again on resume: the budget keys (n_trials, timeout, gpu_hours, retention) may change.
    study.set_user_attr(attrs.N_TRIALS, spec.search.n_trials)
    # The timeout counts from this start, on the database clock that every worker shares.
    timeout = spec.search.timeout_minutes
    study.set_user_attr(attrs.DEADLINE, storage.db.now() + timeout * 60 if timeout > 0 else None)
    study.set_user_attr(attrs.SPEC, spec.to_dict())


def ensure_uid(study: optuna.Study) -> str:
    """The study's id, given it now if it has none (studies made before ids existed)."""
    uid = study.user_attrs.get(attrs.UID)
    if not uid:
        study.set_user_attr(attrs.UID, uuid.uuid4().hex)
        # Re-read: of two hosts giving an old study its id at once, the last write counts.
        uid = study.user_attrs[attrs.UID]
    return str(uid)


def check_same(name: str, stored: StudySpec, given: StudySpec) -> None:
    if diff := difference(stored.identity(), given.identity()):
        raise SpecMismatchError(
            f"study {name!r} exists with a different spec ({diff}); start a new study with "
            f"another --study name, or resume it with its stored spec: `hpsearch worker --study {name}`"
        )


def stored_spec(storage: Storage, name: str) -> StudySpec:
    """The study's stored spec, checked as a spec file is (DamagedSpecError where it fails)."""
    return checked_spec(name, _stored_raw(storage, name))


def readable_spec(storage: Storage, name: str) -> tuple[StudySpec, str | None]:
    """The study's stored spec for reading the study (status, best, reap): where it fails its checks, what of it can
    be read (``salvaged``), with the one line that says it is damaged; else the spec and None."""
    raw = _stored_raw(storage, name)
    try:
        return checked_spec(name, raw), None
    except DamagedSpecError as exc:
        return salvaged(raw), f"{exc}; shown here: what of it can be read"


def _stored_raw(storage: Storage, name: str) -> Any:
    stored_attrs = storage.optuna.get_study_user_attrs(require_study(storage, name))
    if attrs.SPEC not in stored_attrs:
        raise SpecError(
            f"study {name!r} was not created by hpsearch (it has no stored spec); create one with "
            "`hpsearch start --study NAME --config FILE`"
        )
    return stored_attrs[attrs.SPEC]


UNCHECKABLE = (ValueError, TypeError, LookupError, AttributeError)
"""What checking a stored spec can raise on a row no hpsearch wrote (SpecError, a ValueError, among them)."""


def checked_spec(name: str, raw: Any) -> StudySpec:
    """``raw`` (a stored spec: a database row, input like any other) as a checked StudySpec, or DamagedSpecError in
    one line, escaped (the row may hold a newline or an escape sequence) and bounded."""
    try:
        return StudySpec.from_dict(raw)
    except UNCHECKABLE as exc:
        raise DamagedSpecError(
            f"study {name!r}: its stored spec fails its checks ({shown(exc, 300)}); a database writer changed it "
            "and no trial runs on it: restore it from a backup, or start a new study"
        ) from None


def salvaged(raw: Any) -> StudySpec:
    """What of a damaged stored spec can be read, for reading a study only (never for running one): each key of
    [train] and [search] that passes its checks beside the ones kept before it, the others at their defaults; the
    [search.space] parameters that parse; no model, data or adapter (nothing reads them from a finished study)."""
    tables = raw if isinstance(raw, dict) else {}
    search_raw = _table(tables, "search")
    space_raw = search_raw.pop("space", {})
    search_raw.pop("enqueue", None)
    space: dict[str, Param] = {}
    for name, value in space_raw.items() if isinstance(space_raw, dict) else ():
        with suppress(*UNCHECKABLE):
            space[str(name)] = Param.parse(str(name), value)
    train = _salvaged_table(TrainConfig, _table(tables, "train"), "train")
    return StudySpec(ModelConfig(), DataConfig(), train, _salvaged_table(SearchConfig, search_raw, "search"), space)


def _table(tables: dict[str, Any], key: str) -> dict[str, Any]:
    value = tables.get(key)
    return dict(value) if isinstance(value, dict) else {}


C = TypeVar("C", TrainConfig, SearchConfig)


def _salvaged_table(cls: type[C], values: dict[str, Any], where: str) -> C:
    kept: dict[str, Any] = {}
    for _ in range(2):  # twice: a key that needs another (a money budget needs a price) passes once that one is in
        for key, value in values.items():
            if key in kept:
                continue
            with suppress(*UNCHECKABLE):
                from_dict(cls, {**kept, key: value}, where).validate(where)
                kept[key] = value
    return from_dict(cls, kept, where)


def check_spec_before_create(storage: Storage, name: str, spec: StudySpec) -> tuple[bool, str | None]:
    """Raise on a spec mismatch without writing anything (bad input leaves storage untouched); return whether
    the study exists, and its id (``attrs.UID``) if it has one."""
    try:
        study_id = storage.optuna.get_study_id_from_name(name)
    except KeyError:
        return False, None
    stored_attrs = storage.optuna.get_study_user_attrs(study_id)
    stored = stored_attrs.get(attrs.SPEC)
    if stored is None:
        # Another `start` may be creating it right now (its spec is stored last): neither new
        # nor foreign. Its creation row is gone only once the spec is in, so read the spec again.
        if _refuse_foreign(storage, name, study_id, spec, outside_lock=True):
            return True, None
        stored_attrs = storage.optuna.get_study_user_attrs(study_id)
        stored = stored_attrs[attrs.SPEC]
    check_same(name, checked_spec(name, stored), spec)
    uid = stored_attrs.get(attrs.UID)
    return True, str(uid) if uid else None


def _refuse_foreign(storage: Storage, name: str, study_id: int, spec: StudySpec, *, outside_lock: bool) -> bool:
    """Refuse a spec-less study hpsearch is not creating (nor was, when a `start` was cut short): one made with
    Optuna itself, even empty, was never judged by this spec. True for a study being created (``outside_lock``:
    another `start` may be inside its creation now) or cut short; False (only ``outside_lock``) once it has a spec."""
    if _being_created(storage, name):
        if outside_lock or _cut_short(storage, study_id, spec):
            return True
    elif outside_lock and attrs.SPEC in storage.optuna.get_study_user_attrs(study_id):
        return False
    n_trials = len(storage.optuna.get_all_trials(study_id, deepcopy=False))
    directions = ", ".join(d.name.lower() for d in storage.optuna.get_study_directions(study_id))
    raise SpecError(
        f"study {name!r} exists but was not created by hpsearch ({n_trials} trials, "
        f"{directions}); choose another --study name"
    )


def _being_created(storage: Storage, name: str) -> bool:
    if not sqlalchemy.inspect(storage.optuna.engine).has_table(StudyCreation.__tablename__):
        return False  # a storage no hpsearch with creation marks has created a study in
    what = f"read whether study {name!r} is being created"
    return bool(storage.db.run(lambda s: s.get(StudyCreation, name) is not None, what=what))


def _cut_short(storage: Storage, study_id: int, spec: StudySpec) -> bool:
    """What a `start` killed while creating the study leaves: these directions, and no trial ever
    ran (workers refuse a study without a spec), only the queued ones, waiting, and a warm start's copied results."""
    directions = [d.name.lower() for d in storage.optuna.get_study_directions(study_id)]
    states = optuna.trial.TrialState
    return directions == spec.directions and all(
        (t.state == states.WAITING and t.user_attrs.get(attrs.ENQUEUED))
        or (t.state == states.COMPLETE and t.user_attrs.get(attrs.EARLIER_RESULT))
        for t in storage.optuna.get_all_trials(study_id, deepcopy=False)
    )
