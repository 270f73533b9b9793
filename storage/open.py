"""Open a study storage: Optuna's RDB tables plus ours, on one engine per process."""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import optuna
import sqlalchemy
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from hpsearch.storage import urls
from hpsearch.storage.db import DEFAULT_RETRY, Database, RetryPolicy, describe_connect_error, engine_kwargs
from hpsearch.storage.errors import StorageError, StorageUrlError, StudyNotFoundError
from hpsearch.storage.patient import PatientRDBStorage
from hpsearch.storage.tables import Base

log = logging.getLogger(__name__)


@dataclass
class Storage:
    url: str
    """The normalized URL (with password; never print it, use ``display``)."""
    optuna: optuna.storages.RDBStorage
    db: Database

    @property
    def display(self) -> str:
        return urls.mask(self.url)

    def close(self) -> None:
        self.optuna.engine.dispose()


def open_storage(url: str, *, create: bool, retry: RetryPolicy | None = None) -> Storage:
    """Connect to ``url``. With ``create=False`` a missing SQLite file is an error, not a new file."""
    normalized = urls.normalize(url)
    path = urls.sqlite_path(normalized)
    if path is not None:
        _prepare_sqlite(path, create=create, display=urls.mask(url))
    try:
        # Optuna's own schema check reads the version inside an open session on a second
        # connection; with 64 workers starting at once that doubles the connections a server
        # must take. The same check, one query after the other, needs one.
        rdb = PatientRDBStorage(
            normalized,
            engine_kwargs=engine_kwargs(normalized),
            skip_compatibility_check=True,
            skip_table_creation=not create,
        )
        rdb.retry_policy = retry or DEFAULT_RETRY
        if not create and not sqlalchemy.inspect(rdb.engine).has_table("studies"):
            rdb.engine.dispose()
            raise _no_studies(url)
        _check_schema_version(rdb, urls.mask(url))
        if create:
            Base.metadata.create_all(rdb.engine)
    except (OperationalError, optuna.exceptions.StorageInternalError) as exc:
        # The first connection failed: a fixable one-line message (bad host, password, ...).
        # No separate probe connection first: its backend lingers for a moment after close,
        # and 64 workers starting together would briefly hold two connections each.
        # (Optuna wraps the driver's error when its version table is read first.)
        cause = exc if isinstance(exc, OperationalError) else exc.__cause__
        if not create and _missing_tables(cause):
            raise _no_studies(url) from None
        _refuse_bad_option(url, cause or exc)
        if path is None and isinstance(cause, OperationalError):
            raise StorageUrlError(describe_connect_error(normalized, cause)) from None
        raise StorageError(f"cannot open storage {urls.mask(url)}: {str(cause or exc).splitlines()[0]}") from exc
    except SQLAlchemyError as exc:
        if not create and _missing_tables(exc):
            raise _no_studies(url) from None
        _refuse_bad_option(url, exc)
        raise StorageError(f"cannot open storage {urls.mask(url)}: {str(exc).splitlines()[0]}") from exc
    db = Database(rdb.engine, retry=retry) if retry else Database(rdb.engine)
    return Storage(url=normalized, optuna=rdb, db=db)


def _refuse_bad_option(url: str, exc: BaseException) -> None:
    """libpq refuses a URL query option it does not know (``?sslmod=require``): the URL's fault."""
    text = str(exc)
    if "invalid dsn" in text:
        detail = text.split("invalid dsn:", 1)[-1].strip().splitlines()[0]
        raise StorageUrlError(
            f"storage URL {urls.mask(url)}: {detail}; fix or remove that ?option "
            "(libpq's options: sslmode, connect_timeout, application_name, ...)"
        ) from None


def _missing_tables(exc: BaseException | None) -> bool:
    """Optuna's tables are absent: the URL names a database hpsearch never wrote to."""
    text = str(exc or "")
    return "UndefinedTable" in text or "no such table" in text or ("relation" in text and "does not exist" in text)


def _no_studies(url: str) -> StudyNotFoundError:
    # Read-only commands must not turn a wrong database into an Optuna one.
    return StudyNotFoundError(
        f"storage {urls.mask(url)} holds no studies; check --storage / HPSEARCH_STORAGE, or "
        "create a study with `hpsearch start`"
    )


def _check_schema_version(rdb: optuna.storages.RDBStorage, display: str) -> None:
    current, head = rdb.get_current_version(), rdb.get_head_version()
    if current != head:
        raise StorageUrlError(
            f"storage {display} has Optuna schema {current}, this Optuna needs {head}; run "
            f"`optuna storage upgrade --storage URL` (or use the Optuna that created it)"
        )


def _prepare_sqlite(path: Path, *, create: bool, display: str) -> None:
    if path.is_dir():
        raise StorageUrlError(
            f"storage {display}: {path} is a folder; name a file in it, e.g. sqlite:///{path}/hpsearch.db"
        )
    if not path.exists():
        if not create:
            raise StudyNotFoundError(
                f"no study storage at {display} (the file does not exist); run `hpsearch start` "
                "first, or pass --storage / set HPSEARCH_STORAGE to the study's database"
            )
        if not path.parent.is_dir():
            raise StorageUrlError(f"cannot create SQLite storage {display}: folder {path.parent} does not exist")
    # WAL is a property of the file, so set it once before any pooled connection opens:
    # it lets status/dashboard readers run while workers write.
    conn = sqlite3.connect(path, timeout=120)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
    except sqlite3.DatabaseError as exc:
        raise StorageUrlError(
            f"storage {display}: {exc}; point --storage / HPSEARCH_STORAGE at the study's SQLite file"
        ) from None
    finally:
        conn.close()


def study_exists(storage: Storage, name: str) -> bool:
    try:
        storage.optuna.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def require_study(storage: Storage, name: str) -> int:
    try:
        return storage.optuna.get_study_id_from_name(name)
    except KeyError:
        names = [s.study_name for s in storage.optuna.get_all_studies()]
        known = f" (studies there: {', '.join(names)})" if names else " (it holds no studies)"
        raise StudyNotFoundError(
            f"study {name!r} does not exist in {urls.mask(storage.url)}{known}; "
            "create it with `hpsearch start --study NAME`"
        ) from None
