"""The one liveness rule: when a worker counts as lost. Used by the reaper, `hpsearch reap`, `status`'s worker
rows and the ledger (a lost worker's open attempt ends at its last heartbeat). Database clock, each worker's own
heartbeat interval (workers may beat at different rates)."""

from __future__ import annotations

from hpsearch.storage.tables import WorkerRecord

MISSED_BEATS = 3  # a worker is lost after this many missed heartbeats (one late beat is normal under load)


def grace(r: WorkerRecord, grace_s: float | None = None, missed_beats: float = MISSED_BEATS) -> float:
    """How long ``r``'s worker may stay silent: ``missed_beats`` of its own interval, or ``grace_s`` where longer."""
    own = missed_beats * r.heartbeat_s
    return own if grace_s is None else max(own, grace_s)


def is_lost(
    r: WorkerRecord,
    now: float,
    *,
    grace_s: float | None = None,
    missed_beats: float = MISSED_BEATS,
    watched_since: float | None = None,
) -> bool:
    """No clean end, and no heartbeat for longer than its grace by ``now``. Silence counts only from
    ``watched_since`` where given: when the judge's own connection was last known healthy (a database that was
    away kept every beat out)."""
    if r.ended_at is not None:
        return False
    since = r.heartbeat_at if watched_since is None else max(r.heartbeat_at, watched_since)
    return now - since > grace(r, grace_s, missed_beats)
