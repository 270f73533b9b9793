"""Storage URLs: what users type, what SQLAlchemy needs, and what may be printed."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from hpsearch.storage.errors import StorageUrlError

ENV_VAR = "HPSEARCH_STORAGE"
DEFAULT_SQLITE_FILE = "hpsearch.db"

# SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which we do not ship; users type
# bare URLs (and Heroku-style postgres://), so we pin them to psycopg2, the driver we depend on.
_POSTGRES_ALIASES = {"postgresql", "postgres", "postgresql+psycopg2"}


def resolve(url: str | None, *, cwd: Path | None = None) -> str:
    """Return the storage URL to use: explicit, else $HPSEARCH_STORAGE, else the local SQLite file."""
    if url:
        return url
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    path = (cwd or Path.cwd()) / DEFAULT_SQLITE_FILE
    return f"sqlite:///{path}"


def normalize(url: str) -> str:
    """Validate ``url`` and return the SQLAlchemy URL string with an explicit driver."""
    parsed = parse(url)
    return parsed.render_as_string(hide_password=False)


def parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number, a broken [IPv6]
        raise StorageUrlError(
            f"storage URL {mask(url)!r} is not a URL; use sqlite:///path/to/file.db or "
            "postgresql://user:password@host:5432/dbname"
        ) from None
    backend = parsed.get_backend_name()
    if parsed.drivername in _POSTGRES_ALIASES:
        parsed = parsed.set(drivername="postgresql+psycopg2")
        if not parsed.database:
            raise StorageUrlError(
                f"storage URL {mask(url)!r} names no database; add one, e.g. "
                "postgresql://user:password@host:5432/hpsearch"
            )
    elif backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise StorageUrlError(
                f"storage URL {mask(url)!r} is an in-memory SQLite database, which worker "
                "processes cannot share; use a file: sqlite:///hpsearch.db"
            )
    else:
        raise StorageUrlError(
            f"storage URL {mask(url)!r} uses {parsed.drivername!r}; hpsearch supports "
            "postgresql://... and sqlite:///..."
        )
    return parsed


def is_sqlite(url: str) -> bool:
    return parse(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> Path | None:
    parsed = parse(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database is None:
        return None
    return Path(parsed.database)


def mask(url: str) -> str:
    """The URL with its password replaced by ***, safe to print or log."""
    scheme, sep, rest = url.partition("://")
    # An unencoded "@" in the password: a parser splits at the first one and would print the
    # rest of the password as the host.
    if not (sep and rest.split("/", 1)[0].count("@") > 1):
        try:
            return make_url(url).render_as_string(hide_password=True)
        except (ArgumentError, ValueError):
            pass
    # Ambiguous or not parseable: never echo anything before the last "@" (user:password).
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
