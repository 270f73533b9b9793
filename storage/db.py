"""Engines, sessions and retries for the study database: one engine (one connection) per process,
shared by Optuna's RDB storage and our tables; one session scope that wraps driver errors into ``StorageError``."""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg2
import sqlalchemy
from sqlalchemy import Float
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, QueuePool
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.util import queue as sqla_queue

from hpsearch.storage import urls
from hpsearch.storage.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying when the database is unreachable or a transaction is aborted: deadlocks and
    dropped connections are normal with many workers, and giving up would throw away a trial training fine."""

    attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 30.0
    give_up: Callable[[], bool] | None = None  # asked before each retry: True ends them (the process is stopping)

    def delays(self) -> Iterator[float]:
        for attempt in range(self.attempts - 1):
            if self.give_up is not None and self.give_up():
                return
            cap = min(self.max_delay_s, self.base_delay_s * 2**attempt)
            # Full jitter: workers that lost the server together must not reconnect in lockstep.
            yield random.uniform(cap / 2, cap)

    def sleep(self, delay: float) -> None:
        """Wait ``delay`` seconds, cut short as soon as ``give_up`` says so."""
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            if self.give_up is not None and self.give_up():
                return
            time.sleep(min(left, 0.5))


DEFAULT_RETRY = RetryPolicy()
# Long enough to ride out a PostgreSQL restart (issue: database outage mid-search).
OUTAGE_RETRY = RetryPolicy(attempts=40, base_delay_s=0.5, max_delay_s=15.0)
GAVE_UP = "the database stopped answering and this process is stopping"
HELD_TOO_LONG_S = 5.0


class ThreadSharedPool(QueuePool):
    """A QueuePool whose overflow connection is only for the thread that already holds one.

    The trainer and the heartbeat share one pooled connection (docs/decisions.md, "One connection per worker
    process"): another thread waits for it (sessions last milliseconds), while a thread nesting a session in its
    own (Optuna does, creating its tables) gets the overflow one instead of waiting on itself forever.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = threading.local()
        self.give_up: Callable[[], bool] | None = None  # set by give_up_on_silence
        self.unreachable = False

    def recreate(self) -> QueuePool:
        fresh = super().recreate()
        assert isinstance(fresh, ThreadSharedPool)
        fresh.give_up = self.give_up
        return fresh

    def hopeless(self) -> bool:
        return self.unreachable and self.give_up is not None and self.give_up()

    def _do_get(self) -> ConnectionPoolEntry:
        if self.hopeless():
            raise sqlalchemy.exc.TimeoutError(GAVE_UP)
        held = getattr(self._held, "n", 0)
        if held == 0 and self.overflow() >= 0:
            # Every pooled connection exists (overflow counts up from -pool_size) and this thread holds none:
            # wait for one to come back, in slices, since its holder may be stuck on a dead network path.
            began = time.monotonic()
            deadline = began + self._timeout
            while True:
                try:
                    record = self._pool.get(True, min(1.0, max(0.0, deadline - time.monotonic())))
                    break
                except sqla_queue.Empty:
                    if self.give_up is not None and self.give_up() and time.monotonic() - began > HELD_TOO_LONG_S:
                        # A live server's session is back within milliseconds; this one is stuck (a frozen server).
                        self.unreachable = True
                    if self.hopeless():
                        raise sqlalchemy.exc.TimeoutError(GAVE_UP) from None
                    if time.monotonic() >= deadline:
                        raise sqlalchemy.exc.TimeoutError(
                            f"waited {self._timeout:.0f}s for this process's database connection"
                        ) from None
        else:
            record = super()._do_get()
        self._held.n = held + 1
        return record

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        self._held.n = max(0, getattr(self._held, "n", 0) - 1)
        super()._do_return_conn(record)


# SQLAlchemy names a pool's logger after its class and quiets only loggers under
# "sqlalchemy"; keep ours as quiet as the QueuePool it extends (no "Pool disposed" lines).
logging.getLogger(f"{ThreadSharedPool.__module__}.{ThreadSharedPool.__name__}").setLevel(logging.WARNING)


def engine_kwargs(url: str, *, pool_size: int = 1) -> dict[str, Any]:
    """Engine settings for ``url``: few connections, pre-ping, dead-peer detection, lock waits."""
    if urls.sqlite_path(url) is not None:
        return {"connect_args": {"timeout": 120}}  # local workers wait for the file's write lock, not fail
    given = set(urls.parse(url).query)  # options the URL sets itself win over LIBPQ_DEFAULTS
    return {
        "poolclass": ThreadSharedPool,
        "pool_pre_ping": True,
        "pool_size": pool_size,
        "max_overflow": 1,  # only for a thread nesting a session in its own (see ThreadSharedPool)
        "pool_recycle": 1800,
        "connect_args": {k: v for k, v in LIBPQ_DEFAULTS.items() if k not in given},
    }


LIBPQ_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "application_name": "hpsearch",
    # A cloud network fails silently; without these a call waits ~15 minutes for the kernel to give up
    # (docs/postgresql.md, "When a worker cannot connect"). Idle ones are probed, which keeps NATs open too.
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
DEAD_PEER_MS = 20_000  # TCP_USER_TIMEOUT: unacknowledged data closes the connection; a slow query is acknowledged
if psycopg2.__libpq_version__ >= 120000:  # the libpq in psycopg2-binary is newer
    LIBPQ_DEFAULTS["tcp_user_timeout"] = DEAD_PEER_MS


# The server's side of the same rule, set per session: a worker that vanished inside a transaction
# blocks the rows it touched until the server drops its session (two hours by default, ~20 s so).
SERVER_WATCH: dict[str, int] = {
    f"tcp_{key}": LIBPQ_DEFAULTS[key] for key in ("keepalives_idle", "keepalives_interval", "keepalives_count")
}


@sqlalchemy.event.listens_for(ThreadSharedPool, "connect")  # ThreadSharedPool pools only PostgreSQL
def _server_drops_silent_clients(dbapi: Any, _record: Any) -> None:
    settings = dict(SERVER_WATCH)
    if dbapi.server_version >= 120000:
        settings["tcp_user_timeout"] = DEAD_PEER_MS  # unacknowledged replies, as on our side
    sql = "SELECT " + ", ".join(f"set_config('{k}', '{v}', false)" for k, v in settings.items())
    with closing(dbapi.cursor()) as cursor:
        try:
            cursor.execute(sql)
            dbapi.commit()
        except psycopg2.Error as exc:
            # A pooler that refuses them: the search works without, only less well guarded.
            dbapi.rollback()
            log.debug("could not set the server's keepalives: %s", exc)


def give_up_on_silence(engine: Engine, give_up: Callable[[], bool] | None) -> None:
    """Once ``give_up`` says so (a worker stopping for a while), calls on a database already seen unreachable
    fail at once instead of each waiting out a connect timeout: the reaper records later what they would."""
    pool = engine.pool
    if give_up is None or not isinstance(pool, ThreadSharedPool):
        return
    pool.give_up = give_up

    @sqlalchemy.event.listens_for(engine, "handle_error")
    def _seen_failing(ctx: sqlalchemy.engine.ExceptionContext) -> None:
        # A lost connection, or one never made (no Connection yet); not a deadlock, which a live server reports.
        if ctx.is_disconnect or ctx.connection is None:
            engine.pool.unreachable = True  # type: ignore[attr-defined]

    @sqlalchemy.event.listens_for(engine, "connect")
    def _answered(_dbapi: Any, _record: Any) -> None:
        engine.pool.unreachable = False  # type: ignore[attr-defined]


_CONNECT_HINTS: list[tuple[str, str]] = [
    (r"could not translate host name \"?([^\" ]+)\"?", "cannot resolve host {0}; check the host in the storage URL"),
    (
        r"password authentication failed for user \"?([^\" ]+)\"?",
        "PostgreSQL refused the password for user {0}; check user and password in the storage URL",
    ),
    (
        r"role \"?([^\" ]+)\"? does not exist",
        "PostgreSQL has no user {0}; create it (createuser) or fix the user in the storage URL",
    ),
    (
        r"database \"?([^\" ]+)\"? does not exist",
        "database {0} does not exist; create it (createdb {0}) or fix the name in the storage URL",
    ),
    (
        r"Connection refused",
        "nothing accepts connections there; start PostgreSQL, or fix the host/port in the storage URL",
    ),
    (r"timeout expired|timed out", "no answer within 10 s; check the host, the port, the firewall or the SSH tunnel"),
    (
        r"no pg_hba.conf entry",
        "the server's pg_hba.conf does not admit this host; add a host line for it (see docs/postgresql.md)",
    ),
    (
        r"too many clients",
        "the server has no free connections (max_connections); stop idle clients or raise max_connections",
    ),
    (r"SSL", "SSL negotiation failed; set sslmode in the URL (e.g. ?sslmode=require or ?sslmode=disable)"),
    (r"unable to open database file", "cannot open the SQLite file; check that its folder exists and is writable"),
]


def describe_connect_error(url: str, exc: BaseException) -> str:
    """One fixable line for a failed connection to ``url``."""
    where = urls.mask(url)
    text = str(getattr(exc, "orig", exc) or exc)
    for pattern, hint in _CONNECT_HINTS:
        if match := re.search(pattern, text):
            return f"cannot connect to storage {where}: {hint.format(*match.groups())}"
    return f"cannot connect to storage {where}: {one_line(exc)}"


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: lost connections, server restarts, deadlocks, lock timeouts."""
    invalidated = isinstance(exc, DBAPIError) and exc.connection_invalidated
    # TimeoutError: the other thread of this process held the connection too long.
    if invalidated or isinstance(exc, (OperationalError, sqlalchemy.exc.TimeoutError)):
        return True
    code = getattr(getattr(exc, "orig", None), "pgcode", None)
    # 40001 serialization_failure, 40P01 deadlock_detected, 57P01 admin_shutdown, 08xxx connection.
    return bool(code and (code in {"40001", "40P01", "57P01", "57P02", "57P03"} or code.startswith("08")))


def retrying(fn: Callable[[], T], *, policy: RetryPolicy, what: str, transient: Callable[[Exception], bool]) -> T:
    """The one retry loop of storage calls (ours, Optuna's, opening the storage): ``fn`` again after a jittered
    wait while its error is ``transient`` and ``policy`` has waits left; then its last error, as it is. Dropped
    connections, restarted servers and deadlocks are normal with many workers over hours: failing the call at the
    first one would throw away a trial that was training fine."""
    delays = policy.delays()
    while True:
        try:
            return fn()
        except Exception as exc:
            delay = next(delays, None) if transient(exc) else None
            if delay is None:
                raise
            log.warning("%s: transient database error (%s); retrying in %.1fs", what, one_line(exc), delay)
            policy.sleep(delay)


def with_retries(fn: Callable[[], T], *, policy: RetryPolicy = DEFAULT_RETRY, what: str = "storage call") -> T:
    """``retrying`` on our own tables' calls; its last error as a ``StorageError`` that names ``what``."""
    try:
        return retrying(
            fn, policy=policy, what=what, transient=lambda e: isinstance(e, SQLAlchemyError) and is_transient(e)
        )
    except SQLAlchemyError as exc:
        used = ", retries used up" if is_transient(exc) else ""
        raise StorageError(f"{what} failed{used}: {one_line(exc)}") from exc


def one_line(exc: BaseException) -> str:
    """The first line of what the driver said (or the error's type): a log line, a fail reason."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Database:
    """Our own tables in the study database, sharing the engine (and pool) with Optuna."""

    def __init__(self, engine: Engine, *, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.engine = engine
        self.retry = retry
        self._sessions = sessionmaker(bind=engine, expire_on_commit=False)

    def session(self) -> AbstractContextManager[Session]:
        """A transaction: commits on success, rolls back on error, then closes (no retry inside)."""
        return self._sessions.begin()

    @property
    def given_up(self) -> bool:
        """The process is stopping and the database stopped answering (``give_up_on_silence``):
        calls fail at once, so nobody should wait for one in flight either."""
        pool = self.engine.pool
        return isinstance(pool, ThreadSharedPool) and pool.hopeless()

    def run(self, fn: Callable[[Session], T], *, what: str) -> T:
        """Run ``fn`` in its own transaction, retried as a whole on transient errors."""

        def attempt() -> T:
            with self.session() as s:
                return fn(s)

        return with_retries(attempt, policy=self.retry, what=what)

    def now(self) -> float:
        """The database clock, as a Unix timestamp: staleness is judged by it, not by hosts."""
        return self.run(
            lambda s: float(s.execute(sqlalchemy.select(self.clock())).scalar_one()), what="read database clock"
        )

    def clock(self) -> ColumnElement[float]:
        """The database clock as a SQL expression: a write stamps a row with it in the same statement."""
        if self.engine.dialect.name == "sqlite":
            return sqlalchemy.literal_column("((julianday('now') - 2440587.5) * 86400.0)", Float)
        # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
        return sqlalchemy.literal_column("EXTRACT(EPOCH FROM clock_timestamp())", Float)

    def pooled_connection_idle(self) -> bool:
        """True when this process's pooled connection is free (or none is open yet): the heartbeat thread
        borrows it then instead of opening an overflow one."""
        pool = self.engine.pool
        return not isinstance(pool, QueuePool) or pool.checkedout() < pool.size()
