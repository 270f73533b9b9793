"""Open a study storage: Optuna's RDB tables plus ours, on one engine per process."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sqlite3
import tempfile
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
    retrying,
    with_retries,
)
from hpsearch.storage.errors import StorageError, StorageUrlError, StudyNotFoundError
from hpsearch.storage.retrying import RetryingRDBStorage
from hpsearch.storage.shown import shown
from hpsearch.storage.tables import Base

log = logging.getLogger(__name__)
SCHEMA_LOCK_KEY = int.from_bytes(b"hpsearch", "big")  # an advisory lock's bigint key, project-wide
CREATION_LOCK_CLASS = int.from_bytes(b"hps", "big")  # an int4: the other key is the study name's
# Opens of a new storage whose schema another process was creating at that moment: jittered, so the racers part.
CREATION_RACE = RetryPolicy(attempts=4, base_delay_s=0.25, max_delay_s=1.0)


@dataclass
class Storage:
    url: str  # the normalized URL, with password: never print it, use display
    optuna: optuna.storages.RDBStorage
    db: Database
    reader: Callable[[], sqlite3.Connection] | None = None  # opens (read-only) a SQLite file this user cannot write

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
        """Held while a study named ``name`` is created or resumed, across processes and hosts, so two `start`s
        do not both create it. PostgreSQL: a transaction-scoped advisory lock on a connection of its own, which a
        killed process's session gives up with it. SQLite: a lock file (``_file_lock``), as the file's write lock
        cannot be held across Optuna's own connections (they would wait on it)."""
        path = urls.sqlite_path(self.url)
        if path is not None:
            with _file_lock(path):
                yield
            return
        # Two int4 keys: the project's, and the name's checksum (a collision only makes creations take turns).
        keys = {"project": CREATION_LOCK_CLASS, "name": zlib.crc32(name.encode()) - 2**31}
        with _lock_engine(self.url, self.engine_kwargs().get("connect_args", {})) as engine:

            def take() -> sqlalchemy.Connection:
                conn = engine.connect()
                try:
                    conn.begin()
                    conn.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:project, :name)"), keys)
                except BaseException:
                    conn.close()
                    raise
                return conn

            conn = with_retries(take, policy=self.db.retry, what=f"lock study {name!r} for creation")
            with contextlib.closing(conn):  # closing it ends the transaction, and with it the lock
                yield

    def prepare(self) -> None:
        """Make the storage ready for workers: WAL mode for a SQLite file, and our tables. Only where a study is
        created or resumed, and for a new storage: a command that only reads or is refused changes nothing."""
        path = urls.sqlite_path(self.url)
        if path is not None:
            # WAL lets readers run while workers write; it is switched with no other connection open.
            self.optuna.engine.dispose()
            sqlite_file.use_wal(path, self.display)
        with_retries(lambda: Base.metadata.create_all(self.optuna.engine), what=f"create tables in {self.display}")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock among this host's processes on the SQLite file ``path``. In the temporary folder, so a
    study's folder is left as SQLite leaves it; not the file itself: closing it would drop SQLite's own locks."""
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


def check_creatable(url: str) -> None:
    """Refuse, before anything is read or written, a storage that does not exist and cannot be made (a SQLite
    file in a missing or read-only folder); a PostgreSQL database says so when it is opened."""
    path = urls.sqlite_path(url)
    if path is not None:
        sqlite_file.check_sqlite(path, create=True, read_only=False, display=urls.mask(url))


def open_storage(url: str, *, create: bool, read_only: bool = False, retry: RetryPolicy | None = None) -> Storage:
    """Connect to ``url``, writing nothing to a storage that already holds studies.

    ``create=False``: a missing SQLite file is an error, not a new file. ``create=True``: a new storage (no
    studies yet) gets Optuna's tables and ours at once; one with studies gets ours from ``Storage.prepare``.
    ``read_only=True``: a SQLite file this user cannot write is opened read-only instead of refused.
    """
    normalized = urls.normalize(url)
    display = urls.mask(url)
    path = urls.sqlite_path(normalized)
    kwargs = engine_kwargs(normalized)
    if path is not None:
        reader = sqlite_file.check_sqlite(path, create=create, read_only=read_only, display=display)
        if reader is not None:
            kwargs = {"creator": reader}
    lock = _schema_lock(normalized, kwargs) if create and path is None else contextlib.nullcontext()
    policy = retry or DEFAULT_RETRY
    try:
        with lock:
            # Optuna creates each table, then its version rows (a reader too), after checking they are not there: a
            # process between another's check and its insert fails on the other's table or row, and opens again.
            # _schema_lock covers only hpsearch on PostgreSQL, not SQLite nor plain Optuna (docs/failures.md:
            # "several processes open a new storage"). Any other error of the same words is the database's to report.
            return retrying(
                lambda: _open(url, normalized, kwargs, create, display, policy),
                policy=CREATION_RACE,
                what=f"open storage {display} (another process was creating its schema)",
                transient=_lost_creation_race,
            )
    except (SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        # A failed first connection becomes a fixable one-line message (bad host, password, ...). No probe
        # connection first: its backend lingers after close, and 64 workers starting together would hold two
        # each. Optuna wraps the driver's error when its version table is read first.
        cause = exc.__cause__ if isinstance(exc, optuna.exceptions.StorageInternalError) else exc
        if not create and _missing_tables(cause):
            raise _no_studies(url) from None
        _refuse_bad_option(url, cause or exc)
        if path is not None and (said := damaged(cause)):
            raise StorageUrlError(damaged_message(display, said)) from None
        if isinstance(cause, OperationalError) and (path is None or "unable to open" in str(cause)):
            raise StorageUrlError(describe_connect_error(normalized, cause)) from None
        raise StorageError(f"cannot open storage {display}: {str(cause or exc).splitlines()[0]}") from exc


def _open(url: str, normalized: str, kwargs: dict[str, Any], create: bool, display: str, retry: RetryPolicy) -> Storage:
    # Optuna's own schema check reads the version in an open session on a second connection (two per worker);
    # the same check, one query after the other, needs one.
    rdb = RetryingRDBStorage(
        normalized, engine_kwargs=kwargs, skip_compatibility_check=True, skip_table_creation=not create
    )
    rdb.retry_policy = retry
    give_up_on_silence(rdb.engine, retry.give_up)
    if not create and not sqlalchemy.inspect(rdb.engine).has_table("studies"):
        rdb.engine.dispose()
        raise _no_studies(url)
    current, head = rdb.get_current_version(), rdb.get_head_version()
    if current != head:
        raise StorageUrlError(
            f"storage {display} has Optuna schema {current}, this Optuna needs {head}; run "
            f"`optuna storage upgrade --storage URL` (or use the Optuna that created it)"
        )
    storage = Storage(url=normalized, optuna=rdb, db=Database(rdb.engine, retry=retry), reader=kwargs.get("creator"))
    if create and not rdb.get_all_studies():
        storage.prepare()  # a new storage: nothing in it that a refused `start` would have to leave as it was
    return storage


def _lost_creation_race(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, optuna.exceptions.StorageInternalError) else exc
    text = str(getattr(cause, "orig", None) or cause)
    return isinstance(cause, (IntegrityError, OperationalError, ProgrammingError)) and any(
        words in text for words in ("already exists", "UNIQUE constraint failed", "duplicate key")
    )


@contextlib.contextmanager
def _schema_lock(normalized: str, kwargs: dict[str, Any]) -> Iterator[None]:
    """Serialise schema creation on PostgreSQL: of two `start`s on a fresh database, one would fail on the other's
    half-made types (a duplicate key in pg_type). A session-level advisory lock, released as its connection closes."""
    with _lock_engine(normalized, kwargs.get("connect_args", {})) as engine, engine.connect() as conn:
        conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
        yield


@contextlib.contextmanager
def _lock_engine(url: str, connect_args: dict[str, Any]) -> Iterator[sqlalchemy.Engine]:
    """An engine without a pool for a lock's own connection: closing it releases the lock whatever happens."""
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=connect_args)
    try:
        yield engine
    finally:
        engine.dispose()


SQLITE_DAMAGED = ("database disk image is malformed", "file is not a database")


def damaged(exc: BaseException | None) -> str | None:
    """What SQLite said, where ``exc`` (or an error it was raised from) is SQLite finding its file damaged or not a
    database at all: found when a page is read, so at opening or in any later call. None for any other error."""
    while exc is not None:
        if said := next((words for words in SQLITE_DAMAGED if words in str(getattr(exc, "orig", None) or exc)), None):
            return said
        exc = exc.__cause__ or exc.__context__
    return None


def damaged_message(display: str, said: str) -> str:
    return (
        f"storage {display}: the SQLite file is damaged or not a database ({said}); restore it from a backup, "
        "or point --storage / HPSEARCH_STORAGE at another file"
    )


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


def require_study(storage: Storage, name: str) -> int:
    try:
        return storage.optuna.get_study_id_from_name(name)
    except KeyError:
        # Names are rows: escaped and bounded, as any stored text that reaches a terminal (storage/shown.py).
        names = [shown(s.study_name) for s in storage.optuna.get_all_studies()]
        listed = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        known = f" (studies there: {listed})" if names else " (it holds no studies)"
        raise StudyNotFoundError(
            f"study '{shown(name)}' does not exist in {urls.mask(storage.url)}{known}; "
            "create it with `hpsearch start --study NAME`"
        ) from None
