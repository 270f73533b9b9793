"""Storage URLs: what users type, what SQLAlchemy needs, and what may be printed."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote_plus

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
    return url or os.environ.get(ENV_VAR) or f"sqlite:///{(cwd or Path.cwd()) / DEFAULT_SQLITE_FILE}"


def normalize(url: str) -> str:
    """Validate ``url`` and return the SQLAlchemy URL string with an explicit driver."""
    return parse(url).render_as_string(hide_password=False)


def parse(url: str) -> URL:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number, a broken [IPv6]
        raise StorageUrlError(
            f"storage URL {mask(url)!r} is not a URL; use sqlite:///path/to/file.db or "
            f"postgresql://user:password@host:5432/dbname{_at_hint(url)}"
        ) from None
    if parsed.drivername in _POSTGRES_ALIASES:
        parsed = parsed.set(drivername="postgresql+psycopg2")
        _check_user_info(url, parsed)
        if not parsed.database:
            raise StorageUrlError(
                f"storage URL {mask(url)!r} names no database; add one, e.g. "
                "postgresql://user:password@host:5432/hpsearch"
            )
    elif parsed.get_backend_name() == "sqlite":
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


def sqlite_path(url: str) -> Path | None:
    parsed = parse(url)
    return Path(parsed.database) if parsed.get_backend_name() == "sqlite" and parsed.database is not None else None


def mask(url: str) -> str:
    """The URL with every password form the driver would read (``secrets``) as ***: what may be printed."""
    scheme, rest = _split_scheme(_mask_user_info(url))
    if "?" in rest:
        head, query = rest.split("?", 1)
        # ";" too: SQLAlchemy splits options at "&" only, but hiding a little more context leaks nothing.
        parts = re.split(r"([&;])", query)
        query = "".join(p if p in "&;" or not _secret_option(*_key_value(p)) else _hide(p) for p in parts)
        rest = f"{head}?{query}"
    # What no URL parser reads (a libpq "host=h password=pw" string): its password= values, quoted or not.
    return _CONNINFO_SECRET.sub(r"\1***", scheme + rest)


def secrets(url: str) -> list[str]:
    """Every form in which ``url`` hands the driver a password, as the driver reads it: SQLAlchemy's URL parser
    (user:password@, each ?option with its key and value percent-decoded), then what psycopg2 passes to libpq (an
    option's value may itself be a conninfo string, ``?dsn=...``, or another URL). Empty: nothing secret."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return ["a password="] if _CONNINFO_SECRET.search(url) else []
    found = ["user:password@"] if parsed.password is not None else []
    for key, values in parsed.query.items():
        for value in (values,) if isinstance(values, str) else values:
            if _secret_option(key, value):
                found.append(f"?{key}=")
    return found


def refuse_secrets(url: str) -> None:
    """Raise StorageUrlError (one line, exit 2) if ``url`` carries any password (``secrets``): for a URL that is
    stored (a warm start's, in the spec) or shown, where no form of a secret belongs."""
    if found := secrets(url):
        raise StorageUrlError(
            f"{mask(url)} holds a password ({', '.join(dict.fromkeys(found))}), which would be stored "
            "with the study and shown on the dashboard; put it in ~/.pgpass or PGPASSWORD and leave it out of the URL"
        )


# libpq's connection keywords that carry a secret (passfile and sslkey name files, which may be shown).
_SECRET_KEYS = ("password", "sslpassword")
_CONNINFO_SECRET = re.compile(r"((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;'\\]+)", re.IGNORECASE)


def _key_value(part: str) -> tuple[str, str]:
    key, _, value = part.partition("=")
    return unquote_plus(key), unquote_plus(value)


def _secret_option(key: str, value: str) -> bool:
    """A URL option the driver takes as a password: its key (any case: a key is compared as typed, and hiding
    one the driver would refuse costs nothing), or a value that is itself a conninfo or URL holding one."""
    if key.strip().lower() in _SECRET_KEYS:
        return True
    if _CONNINFO_SECRET.search(value):
        return True
    return "://" in value and bool(secrets(value))  # a shorter string each time: the recursion ends


def _hide(part: str) -> str:
    return f"{part.partition('=')[0]}=***"


def _mask_user_info(url: str) -> str:
    scheme, rest = _split_scheme(url)
    if "@" not in rest or scheme.startswith("sqlite"):
        return url  # no user info, so no password (an "@" in a SQLite path is part of the path)
    if rest.count("@") == 1:
        try:
            parsed = make_url(url)
        except (ArgumentError, ValueError):
            parsed = None
        # Only if the parser found a user did it end user:password at the "@"; else ("us/er:pw@host") it would print
        # the password as part of the host or path.
        if parsed is not None and parsed.username is not None:
            return parsed.render_as_string(hide_password=True)
    # An unencoded "@" in the password, or a URL no parser reads: user and password end at the last "@" (as
    # browsers read it); an ?option with an "@" is hidden too, which costs a little context and leaks nothing.
    return f"{scheme}***@{rest.rsplit('@', 1)[1]}"


def _split_scheme(url: str) -> tuple[str, str]:
    """("postgresql://", "user:pw@host/db"); a scheme typed with one slash or none still counts."""
    match = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/*", url)
    return (url[: match.end()], url[match.end() :]) if match else ("", url)


def _check_user_info(url: str, parsed: URL) -> None:
    """Refuse a PostgreSQL URL whose user:password the parser split in the wrong place: SQLAlchemy ends the
    password at the first "@", and the rest would become the host, sent to DNS and printed in the driver's error."""
    rest = _split_scheme(url)[1]
    if rest.split("?", 1)[0].count("@") > 1 or "@" in (parsed.host or ""):
        raise StorageUrlError(f"storage URL {mask(url)!r} has more than one '@'{_ENCODE_HINT}")
    if "@" in rest.split("?", 1)[0] and parsed.username is None:
        raise StorageUrlError(
            f"storage URL {mask(url)!r}: the part before '@' is not user:password; percent-encode "
            f"special characters in the user name and password ({_SPECIALS})"
        )


_SPECIALS = "'@' %40, ':' %3A, '/' %2F, '?' %3F, '#' %23, '%' %25"
_ENCODE_HINT = f"; write an '@' in a user name or password as %40 (percent-encode special characters: {_SPECIALS})"


def _at_hint(url: str) -> str:
    scheme, rest = _split_scheme(url)
    return _ENCODE_HINT if not scheme.startswith("sqlite") and rest.split("?", 1)[0].count("@") > 1 else ""
