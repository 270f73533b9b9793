"""Optuna's RDB storage with retries: a database outage is waited out (``db.retrying``), not fatal to every
``trial.report`` and ``study.tell`` of trials that were training fine."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from optuna.storages._heartbeat import BaseHeartbeat
from sqlalchemy.exc import SQLAlchemyError

from hpsearch.storage.db import DEFAULT_RETRY, RetryPolicy, is_transient, retrying

F = TypeVar("F", bound=Callable[..., Any])


def _transient(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, StorageInternalError) else exc
    return isinstance(cause, SQLAlchemyError) and is_transient(cause)


def _retrying(name: str, method: F) -> F:
    @functools.wraps(method)
    def call(self: RetryingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        tries = 0

        def once() -> Any:
            nonlocal tries
            tries += 1
            try:
                return method(self, *args, **kwargs)
            except UpdateFinishedTrialError:
                # A repeat of a state change whose first attempt did commit (its answer was lost) has succeeded.
                if tries > 1 and name == "set_trial_state_values":
                    return True
                raise

        return retrying(once, policy=self.retry_policy, what=f"optuna {name}", transient=_transient)

    return call  # type: ignore[return-value]


class RetryingRDBStorage(optuna.storages.RDBStorage):
    """An RDBStorage whose calls wait out transient database errors."""

    retry_policy: RetryPolicy = DEFAULT_RETRY


# Every call of Optuna's storage interfaces, as RDBStorage implements it: a method a new Optuna adds is covered
# without a list of names to keep up to date. Each is a read, an upsert, or made safe to repeat above.
for _base in (optuna.storages.BaseStorage, BaseHeartbeat):
    for _name, _ in inspect.getmembers(_base, inspect.isfunction):
        if not _name.startswith("_"):
            setattr(RetryingRDBStorage, _name, _retrying(_name, getattr(optuna.storages.RDBStorage, _name)))
