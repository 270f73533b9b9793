"""Optuna's RDB storage with retries: a database outage is waited out (``db.RetryPolicy``), not fatal to every
``trial.report`` and ``study.tell`` of trials that were training fine."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from sqlalchemy.exc import SQLAlchemyError

from hpsearch.storage.db import DEFAULT_RETRY, RetryPolicy, is_transient

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

# Calls a retry may repeat after the first attempt reached the server: upserts and reads.
# ``set_trial_state_values`` is made safe below (a repeat that finds the trial finished
# with the state we asked for has succeeded).
_METHODS = [
    "create_new_study",
    "delete_study",
    "set_study_user_attr",
    "set_study_system_attr",
    "get_study_id_from_name",
    "get_study_name_from_id",
    "get_study_directions",
    "get_study_user_attrs",
    "get_study_system_attrs",
    "get_all_studies",
    "create_new_trial",
    "set_trial_param",
    "get_trial_id_from_study_id_trial_number",
    "set_trial_state_values",
    "set_trial_intermediate_value",
    "set_trial_user_attr",
    "set_trial_system_attr",
    "get_trial",
    "get_all_trials",
    "get_n_trials",
    "get_best_trial",
    "record_heartbeat",
]


def _transient(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, StorageInternalError) else exc
    return isinstance(cause, SQLAlchemyError) and is_transient(cause)


def _retrying(name: str, method: F) -> F:
    @functools.wraps(method)
    def call(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        delays = self.retry_policy.delays()
        attempt = 0
        while True:
            try:
                return method(self, *args, **kwargs)
            except UpdateFinishedTrialError:
                # A repeat of a state change whose first attempt did commit.
                if attempt and name == "set_trial_state_values":
                    return True
                raise
            except (StorageInternalError, SQLAlchemyError) as exc:
                delay = next(delays, None)
                if not _transient(exc) or delay is None:
                    raise
                attempt += 1
                why = str(exc.__cause__ or exc).splitlines()[0]
                log.warning("database unreachable during %s (%s); retry %d in %.1fs", name, why, attempt, delay)
                self.retry_policy.sleep(delay)

    return call  # type: ignore[return-value]


class RetryingRDBStorage(optuna.storages.RDBStorage):
    """An RDBStorage whose calls wait out transient database errors."""

    retry_policy: RetryPolicy = DEFAULT_RETRY


for _name in _METHODS:
    if hasattr(optuna.storages.RDBStorage, _name):
        setattr(RetryingRDBStorage, _name, _retrying(_name, getattr(optuna.storages.RDBStorage, _name)))
