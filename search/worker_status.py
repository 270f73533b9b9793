"""What `status` shows about the workers of a study: who runs what, on which host, for how long."""

from __future__ import annotations

from typing import Any

from hpsearch.storage import worker_views
from hpsearch.storage.db import Database


def summary(db: Database, study: str) -> dict[str, Any]:
    """The registry's view of ``study``, as plain data for `status --json`."""
    workers = worker_views.list_workers(db, study)
    return {
        "workers": [w.to_dict() for w in workers],
        "workers_by_state": {state: sum(w.state == state for w in workers) for state in ("live", "lost", "finished")},
        "gpu_hours": worker_views.device_hours(workers, gpu_only=True),
        "device_hours": worker_views.device_hours(workers, gpu_only=False),
    }


def format_workers(s: dict[str, Any]) -> str:
    by = s["workers_by_state"]
    lines = [
        f"workers: {by['live']} live, {by['lost']} lost, {by['finished']} finished  "
        f"GPU-hours {s['gpu_hours']:.3f}  (all devices {s['device_hours']:.3f} h)"
    ]
    hosts = sorted({w["host"] for w in s["workers"] if w["state"] != "finished"})
    if hosts:
        lines[0] += f"  on {len(hosts)} host{'s' if len(hosts) != 1 else ''}"
    # Live and lost first: those are the ones a user acts on; finished ones are history.
    order = {"live": 0, "lost": 1, "finished": 2}
    for w in sorted(s["workers"], key=lambda w: (order[w["state"]], w["host"], w["device"])):
        doing = f"trial {w['current_trial']}" if w["current_trial"] is not None else "idle"
        if w["state"] == "finished":
            doing = "done"
        elif w["state"] == "lost":
            doing = f"no heartbeat for {_duration(w['heartbeat_age_s'])}" + (
                f" (was on trial {w['current_trial']})" if w["current_trial"] is not None else ""
            )
        lines.append(
            f"  {w['state']:<8} {w['host']:<20} {w['device']:<8} pid {w['pid']:<7} {doing:<24} "
            f"trials {w['trials_finished']:<4} {w['device_seconds'] / 3600:.3f} h"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"
