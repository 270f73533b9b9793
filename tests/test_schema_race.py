"""Several `hpsearch start`s on a fresh PostgreSQL database create its schema once, without error.

Each start creates the tables of a new storage; done at the same moment, one of them used to fail
on the other's half-made types (duplicate key in pg_type), so a user who started a study on two
instances at once saw one of them die.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any


def _open(url: str, barrier: Any, errors: Any) -> None:
    from hpsearch.storage.open import open_storage

    barrier.wait()
    try:
        open_storage(url, create=True).close()
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def test_concurrent_creation_of_a_fresh_schema(pg_url: str) -> None:
    # Without the lock this failed on every run: four processes meet at a barrier first.
    ctx = mp.get_context("spawn")
    n = 4
    barrier, errors = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_open, args=(pg_url, barrier, errors)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert all(p.exitcode == 0 for p in procs)
