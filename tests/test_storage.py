"""Storage contract, run against every backend: SQLite always, PostgreSQL for real."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from hpsearch.storage import slots, urls
from hpsearch.storage.errors import StorageUrlError, StudyNotFoundError
from hpsearch.storage.open import open_storage, require_study
from tests.support import netns


def test_bare_postgres_url_uses_psycopg2() -> None:
    assert urls.normalize("postgresql://u:p@h:5432/db").startswith("postgresql+psycopg2://")
    assert urls.normalize("postgres://u:p@h/db").startswith("postgresql+psycopg2://")


def test_password_is_masked() -> None:
    assert "s3cret" not in urls.mask("postgresql://hp:s3cret@10.0.0.5:5432/hpsearch")
    assert urls.mask("postgresql://hp:s3cret@10.0.0.5:5432/hpsearch").startswith("postgresql://hp:***@")
    # An unencoded "@" in the password: no part of it may show as the host.
    assert urls.mask("postgresql://hp:s3@cret@10.0.0.5:5432/hpsearch") == "postgresql://***@10.0.0.5:5432/hpsearch"


@pytest.mark.parametrize("url", ["redis://h/0", "sqlite://", "postgresql://u@h:5432"])
def test_unsupported_urls_are_user_errors(url: str) -> None:
    with pytest.raises(StorageUrlError):
        urls.normalize(url)


def test_env_var_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(urls.ENV_VAR, "sqlite:///from-env.db")
    assert urls.resolve(None) == "sqlite:///from-env.db"
    assert urls.resolve("sqlite:///explicit.db") == "sqlite:///explicit.db"
    monkeypatch.delenv(urls.ENV_VAR)
    assert urls.resolve(None, cwd=tmp_path) == f"sqlite:///{tmp_path / 'hpsearch.db'}"


def test_budget_is_exact_under_concurrent_claims(storage_url: str) -> None:
    storage = open_storage(storage_url, create=True)
    claimed: list[int | None] = []
    lock = threading.Lock()

    def claimer(i: int) -> None:
        own = open_storage(storage_url, create=False)
        try:
            while True:
                slot = slots.claim_slot(own.db, "s", 7, f"w{i}")
                with lock:
                    claimed.append(slot)
                if slot is None:
                    return
        finally:
            own.close()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [s for s in claimed if s is not None]
    assert sorted(got) == list(range(7)), "every slot claimed exactly once, never more than the budget"
    assert slots.used_slots(storage.db, "s") == 7
    slots.bind_slot(storage.db, "s", 3, trial_number=42)
    slots.release_slot(storage.db, "s", trial_number=42)
    assert slots.claim_slot(storage.db, "s", 7, "again") == 3
    storage.close()


def test_missing_study_is_a_clear_error(storage_url: str) -> None:
    storage = open_storage(storage_url, create=True)
    with pytest.raises(StudyNotFoundError, match="study 'ghost' does not exist"):
        require_study(storage, "ghost")
    storage.close()


def test_database_clock_is_sane(storage_url: str) -> None:
    import time

    storage = open_storage(storage_url, create=True)
    assert abs(storage.db.now() - time.time()) < 5
    storage.close()


def test_a_shutdown_cuts_the_retries_through_an_outage_short() -> None:
    import time

    from sqlalchemy.exc import OperationalError

    from hpsearch.storage.db import OUTAGE_RETRY, with_retries
    from hpsearch.storage.errors import StorageError

    shutting_down = {"now": False}
    policy = replace(OUTAGE_RETRY, give_up=lambda: shutting_down["now"])
    calls = []

    def unreachable() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            shutting_down["now"] = True  # SIGTERM arrives while the database is away
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    began = time.monotonic()
    with pytest.raises(StorageError, match="retries used up: connection refused"):
        with_retries(unreachable, policy=policy)
    # Three attempts, then no more (OUTAGE_RETRY alone would try 40 times, for minutes).
    assert len(calls) == 3 and time.monotonic() - began < 5
    # A wait already begun ends too: the give-up is checked while it sleeps.
    began = time.monotonic()
    policy.sleep(30.0)
    assert time.monotonic() - began < 5


def test_libpq_options_in_the_url_win_over_hpsearchs_defaults() -> None:
    from hpsearch.storage.db import LIBPQ_DEFAULTS, engine_kwargs

    given = engine_kwargs("postgresql://u@db.example:5432/hp?connect_timeout=30&keepalives_idle=300")["connect_args"]
    # SQLAlchemy lets connect_args overwrite the URL's options: ours must leave them out.
    assert "connect_timeout" not in given and "keepalives_idle" not in given
    assert given["keepalives_count"] == LIBPQ_DEFAULTS["keepalives_count"]
    plain = engine_kwargs("postgresql://u@db.example:5432/hp")["connect_args"]
    assert plain["connect_timeout"] == 10 and plain["tcp_user_timeout"] > 0


def test_a_stopping_process_stops_waiting_on_a_database_seen_unreachable() -> None:
    import time

    import sqlalchemy

    from hpsearch.storage import urls
    from hpsearch.storage.db import GAVE_UP, engine_kwargs, give_up_on_silence
    from tests.support.pgcluster import free_port

    # Nothing listens there: each attempt is a refused connection.
    url = urls.normalize(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres")
    engine = sqlalchemy.create_engine(url, **engine_kwargs(url))
    stopping = {"now": False}
    give_up_on_silence(engine, lambda: stopping["now"])
    with pytest.raises(sqlalchemy.exc.OperationalError):
        engine.connect()  # seen unreachable, but not stopping: it was really tried
    stopping["now"] = True
    began = time.monotonic()
    with pytest.raises(sqlalchemy.exc.TimeoutError, match=GAVE_UP):
        engine.connect()
    assert time.monotonic() - began < 1
    engine.dispose()


@pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 to make a network namespace")
def test_a_host_that_vanishes_mid_transaction_blocks_the_others_for_seconds_not_hours() -> None:
    import subprocess
    import time

    import sqlalchemy

    from hpsearch.storage.tables import TrialSlot
    from tests.support.pgcluster import Cluster

    host = netns.Host()  # PostgreSQL's instance; this process plays a worker's instance
    cluster = Cluster(host=host)
    try:
        cluster.start()
        storage = open_storage(cluster.url, create=True)
        conn = storage.optuna.engine.connect()
        # A worker claims trial slot 0, and its instance vanishes before the commit: not even
        # its FIN reaches the server, which holds the uncommitted row.
        conn.execute(sqlalchemy.insert(TrialSlot).values(study_name="s", slot=0, worker="a", claimed_at=0.0))
        host.cut(both_ways=True)
        # Another worker (on the server's instance, which still reaches it) claims the same
        # slot: its insert waits for the first one's transaction to end.
        insert = "INSERT INTO hpsearch_budget_slots (study_name, slot, worker, claimed_at) VALUES ('s', 0, 'b', 0)"
        psql = [*host.prefix(), "psql", "-h", host.address, "-p", str(cluster.port), "-U", "postgres", "-c", insert]
        began = time.monotonic()
        try:
            other = subprocess.run(psql, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the server still held the vanished worker's transaction after 180 s")
        # It was two hours (the kernel's keepalive default) before the server was told to probe.
        assert other.returncode == 0 and time.monotonic() - began < 90, other.stderr
        conn.invalidate()
        storage.close()
    finally:
        cluster.destroy()
        host.destroy()
