"""A SQLite storage's file: is it one, can this user write it, and its journal mode."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from hpsearch.storage import mounts
from hpsearch.storage.errors import StorageError, StorageUrlError, StudyNotFoundError

log = logging.getLogger(__name__)
SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite(path: Path, *, create: bool, read_only: bool, display: str) -> Callable[[], sqlite3.Connection] | None:
    """Refuse, with the reason, a path SQLite cannot use; nothing is written to it here. Returns a read-only
    connector when ``read_only`` and this user cannot write the file."""
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
        try:
            # What SQLite is about to do, so read-only mounts and /proc fail here with the reason, not in the driver.
            tempfile.TemporaryFile(dir=path.parent).close()
        except OSError as exc:
            why = f" ({exc.strerror})" if exc.strerror and exc.errno != errno.ENOENT else ""  # ENOENT: /proc
            raise StorageUrlError(
                f"cannot create SQLite storage {display}: folder {path.parent} is not writable{why}; "
                "point --storage / HPSEARCH_STORAGE at a file in a folder you can write to"
            ) from None
        return None
    if not path.is_file():
        raise StorageUrlError(
            f"storage {display}: {path} is not a regular file, so not a database; point --storage / "
            "HPSEARCH_STORAGE at the study's SQLite file"
        )
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise StorageUrlError(f"storage {display}: cannot read {path} ({exc.strerror or exc})") from None
    if head and head != SQLITE_MAGIC:  # an empty file is an empty database
        raise StorageUrlError(
            f"storage {display}: file is not a database; point --storage / HPSEARCH_STORAGE at the study's SQLite file"
        )
    # access() also sees read-only mounts.
    if not os.access(path, os.W_OK):
        refused = f"{path} is read-only"
    elif not os.access(path.parent, os.W_OK):
        refused = f"its folder {path.parent} is not writable (SQLite keeps its journal beside the file)"
    else:
        return None
    if read_only and not create:
        return read_only_connector(path)
    raise StorageUrlError(
        f"storage {display}: {refused}, and this command writes to the study; make it writable "
        "(hpsearch status, best and dashboard read it as it is)"
    )


def read_only_connector(path: Path) -> Callable[[], sqlite3.Connection]:
    query = "mode=ro"
    if not os.access(path.parent, os.W_OK) and not any(
        Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal")
    ):
        # A WAL reader needs a -shm file beside it, which a read-only folder cannot hold; with no -wal or journal
        # there, the file alone is the whole database, and "immutable" reads it without one.
        query += "&immutable=1"
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?{query}"
    return functools.partial(sqlite3.connect, uri, uri=True, timeout=120, check_same_thread=False)


def use_wal(path: Path, display: str) -> None:
    kind = mounts.filesystem(path.parent)
    if mounts.is_network(kind):
        # Said, not refused: one host's workers there work in rollback-journal mode, and there may be no other disk.
        log.warning(
            "storage %s is on a network file system (%s): SQLite's locks do not hold there and its WAL "
            "would corrupt the file; keeping the rollback journal. Put the file on a local disk, and use "
            "PostgreSQL for workers on several hosts (README: Adding GPUs from another instance)",
            display,
            kind,
        )
        return
    with contextlib.closing(sqlite3.connect(path, timeout=120)) as conn:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"storage {display}: cannot switch it to WAL mode: {exc}") from None
