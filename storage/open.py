"""Open a study storage: Optuna's RDB tables plus ours, on one engine per process."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import sqlite3
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError

from hpsearch.storage import sqlite_file, urls
from hpsearch.storage.db import (
    DEFAULT_RETRY,
    Database,
    RetryPolicy,
    describe_connect_error,
    engine_kwargs,
    give_up_on_silence,
    with_retries,
)
from hpsearch.storage.errors import StorageError, StorageUrlError, StudyNotFoundError
from hpsearch.storage.retrying import RetryingRDBStorage
from hpsearch.storage.tables import Base

log = logging.getLogger(__name__)
SCHEMA_LOCK_KEY = int.from_bytes(b"hpsearch", "big")  # an advisory lock's bigint key, project-wide
CREATION_LOCK_CLASS = int.from_bytes(b"hps", "big")  # an int4: the other key is the study name's
CREATION_ATTEMPTS = 4
"""How often a process opens a new storage whose schema another one was creating at the same moment."""


@dataclass
class Storage:
    url: str
    """The normalized URL (with password; never print it, use ``display``)."""
    optuna: optuna.storages.RDBStorage
    db: Database
    reader: Callable[[], sqlite3.Connection] | None = None
    """How a SQLite file this user cannot write is opened (read-only), else None."""

    @property
    def display(self) -> str:
        return urls.mask(self.url)

    @property
    def read_only(self) -> bool:
        return self.reader is not None

    def engine_kwargs(self, *, pool_size: int = 1) -> dict[str, Any]:
        """Settings for another engine on the same storage, opened the same way."""
        return {"creator": self.reader} if self.reader else engine_kwargs(self.url, pool_size=pool_size)

    def close(self) -> None:
        self.optuna.engine.dispose()

    @contextlib.contextmanager
    def creation_lock(self, name: str) -> Iterator[None]:
        """Held while a study named ``name`` is created or resumed, across processes and hosts.

        Two `start`s of a new study would otherwise both create it (each queueing the spec's
        enqueued trials), the last one's spec winning. PostgreSQL: a transaction-scoped advisory
        lock keyed by the name, on a connection of its own that a killed process's server
        session gives up with it. SQLite: the file's write lock cannot be held across Optuna's
        own connections (they would wait on it), so a lock file (``_file_lock``).
        """
        path = urls.sqlite_path(self.url)
        if path is not None:
            with _file_lock(path):
                yield
            return
        engine = sqlalchemy.create_engine(
            self.url, poolclass=sqlalchemy.pool.NullPool, connect_args=self.engine_kwargs().get("connect_args", {})
        )
        # Two int4 keys: the project's, and the name's checksum (a collision only makes two
        # studies' creations take turns).
        keys = {"project": CREATION_LOCK_CLASS, "name": zlib.crc32(name.encode()) - 2**31}

        def take() -> sqlalchemy.Connection:
            conn = engine.connect()
            try:
                conn.begin()
                conn.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:project, :name)"), keys)
            except BaseException:
                conn.close()
                raise
            return conn

        try:
            conn = with_retries(take, policy=self.db.retry, what=f"lock study {name!r} for creation")
            try:
                yield
            finally:
                conn.close()  # ends the transaction, and with it the lock
        finally:
            engine.dispose()

    def prepare(self) -> None:
        """Make the storage ready for workers: WAL mode for a SQLite file, and our tables.

        Called where a study is created or resumed (``create_or_resume``), and by
        ``open_storage`` for a new storage; never by a command that only reads or that is
        refused, so those leave a database exactly as they found it.
        """
        path = urls.sqlite_path(self.url)
        if path is not None:
            # WAL lets status/dashboard readers run while workers write. It is a property of
            # the file, switched with no other connection open: the pool's are closed first.
            self.optuna.engine.dispose()
            sqlite_file.use_wal(path, self.display)
        with_retries(lambda: Base.metadata.create_all(self.optuna.engine), what=f"create tables in {self.display}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock among this host's processes on the SQLite file ``path`` (one host's file).

    In the temporary folder, not beside the database: a folder holding a study file is left
    as SQLite leaves it. Not the database file itself: closing any descriptor of it would drop
    SQLite's own locks in this process."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    lock = Path(tempfile.gettempdir()) / f"hpsearch-{key}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        fd = os.open(lock, os.O_RDONLY)  # another user's lock file: flock needs no write access
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released on close, or when the process dies
        yield
    finally:
        os.close(fd)


def open_storage(url: str, *, create: bool, read_only: bool = False, retry: RetryPolicy | None = None) -> Storage:
    """Connect to ``url``, writing nothing to a storage that already holds studies.

    ``create=False``: a missing SQLite file is an error, not a new file. ``create=True``: a new
    storage (no studies yet) gets Optuna's tables and ours at once; one that holds studies
    gets ours only from ``Storage.prepare``, once the command is known to go ahead.
    ``read_only=True`` (commands that only read): a SQLite file this user cannot write is
    opened read-only instead of refused.
    """
    normalized = urls.normalize(url)
    display = urls.mask(url)
    path = urls.sqlite_path(normalized)
    kwargs = engine_kwargs(normalized)
    if path is not None:
        reader = sqlite_file.check_sqlite(path, create=create, read_only=read_only, display=display)
        if reader is not None:
            kwargs = {"creator": reader}
    try:
        with _schema_lock(normalized, kwargs, create and path is None):
            storage = _open_once_created(url, normalized, kwargs, create, display, retry or DEFAULT_RETRY)
        storage.reader = kwargs.get("creator")
    except (OperationalError, optuna.exceptions.StorageInternalError) as exc:
        # The first connection failed: a fixable one-line message (bad host, password, ...).
        # No separate probe connection first: its backend lingers for a moment after close,
        # and 64 workers starting together would briefly hold two connections each.
        # (Optuna wraps the driver's error when its version table is read first.)
        cause = exc if isinstance(exc, OperationalError) else exc.__cause__
        if not create and _missing_tables(cause):
            raise _no_studies(url) from None
        _refuse_bad_option(url, cause or exc)
        if isinstance(cause, OperationalError) and (path is None or "unable to open" in str(cause)):
            raise StorageUrlError(describe_connect_error(normalized, cause)) from None
        raise StorageError(f"cannot open storage {display}: {str(cause or exc).splitlines()[0]}") from exc
    except SQLAlchemyError as exc:
        if not create and _missing_tables(exc):
            raise _no_studies(url) from None
        _refuse_bad_option(url, exc)
        raise StorageError(f"cannot open storage {display}: {str(exc).splitlines()[0]}") from exc
    return storage


def _open(url: str, normalized: str, kwargs: dict[str, Any], create: bool, display: str, retry: RetryPolicy) -> Storage:
    # Optuna's own schema check reads the version inside an open session on a second
    # connection; with 64 workers starting at once that doubles the connections a server
    # must take. The same check, one query after the other, needs one.
    rdb = RetryingRDBStorage(
        normalized,
        engine_kwargs=kwargs,
        skip_compatibility_check=True,
        skip_table_creation=not create,
    )
    rdb.retry_policy = retry
    give_up_on_silence(rdb.engine, retry.give_up)
    if not create and not sqlalchemy.inspect(rdb.engine).has_table("studies"):
        rdb.engine.dispose()
        raise _no_studies(url)
    _check_schema_version(rdb, display)
    storage = Storage(url=normalized, optuna=rdb, db=Database(rdb.engine, retry=retry))
    if create and not rdb.get_all_studies():
        # A new storage: nothing in it that a refused `start` would have to leave as it was.
        storage.prepare()
    return storage


def _open_once_created(
    url: str, normalized: str, kwargs: dict[str, Any], create: bool, display: str, retry: RetryPolicy
) -> Storage:
    """``_open``, again when another process was creating the same new schema at that moment.

    Optuna creates each table, and then its version rows, after checking that they are not
    there yet: a process that comes between another's check and its insert fails on the
    other's table ("already exists") or row (a unique key). Our lock prevents that only among
    hpsearch processes on PostgreSQL; on SQLite, and against plain Optuna (optuna-dashboard or a
    user's script opening the new file), nothing does. A reader is not spared: Optuna writes its
    version rows on opening a storage that lacks them. The other process has made the schema by
    then, or nearly: a later attempt finds it and goes on. Bounded, since any other error of
    the same words is the database's to report.
    """
    attempt = 1
    while True:
        try:
            return _open(url, normalized, kwargs, create, display, retry)
        except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
            if attempt == CREATION_ATTEMPTS or not _lost_creation_race(exc):
                raise
        log.debug("storage %s: another process created its schema at the same time; opening it again", display)
        time.sleep(random.uniform(0.05, 0.25) * attempt)  # jittered, so that the racers do not meet again
        attempt += 1


def _lost_creation_race(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, optuna.exceptions.StorageInternalError) else exc
    text = str(getattr(cause, "orig", None) or cause)
    return isinstance(cause, (IntegrityError, OperationalError, ProgrammingError)) and any(
        words in text for words in ("already exists", "UNIQUE constraint failed", "duplicate key")
    )


@contextlib.contextmanager
def _schema_lock(normalized: str, kwargs: dict[str, Any], needed: bool) -> Iterator[None]:
    """Serialise schema creation on PostgreSQL: two `hpsearch start`s on a fresh database would
    both create Optuna's tables, and one fails on the other's half-made types (a duplicate key
    in pg_type). A session-level advisory lock, on a connection of its own that closes (and so
    releases it) whatever happens. SQLite has no such lock: ``_open_once_created`` opens again there."""
    if not needed:
        yield
        return
    engine = sqlalchemy.create_engine(
        normalized, poolclass=sqlalchemy.pool.NullPool, connect_args=kwargs.get("connect_args", {})
    )
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            yield
    finally:
        engine.dispose()


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
