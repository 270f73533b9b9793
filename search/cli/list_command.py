"""`hpsearch list`: every study in a storage, one line each (its trials by state, its best value, its live
workers); ``list_studies`` is the same as data, for ``hpsearch.studies()``. Reads, never writes."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass

import optuna
import sqlalchemy
from optuna.trial import TrialState

from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.study import budget, objectives, studies, warm_start
from hpsearch.search.views import summary
from hpsearch.storage import attrs, liveness, urls
from hpsearch.storage.open import Storage, open_storage
from hpsearch.storage.tables import WorkerRecord


@dataclass(frozen=True)
class StudyRow:
    """One study of a storage, as `hpsearch list` shows it."""

    name: str
    states: dict[str, int]
    """Its trials by state (complete, pruned, fail, running, waiting), lower-case as in `status --json`."""
    n_trials: int | None
    """Its trial budget; None for a study hpsearch did not create (no stored spec)."""
    metric: str | None
    """The quality objective's name; None for a study hpsearch did not create."""
    best_value: float | None
    """The best trial's quality objective, as `status` ranks them; None before a trial completed."""
    live_workers: int
    """Workers on any host whose heartbeats are fresh."""


def list_studies(url: str) -> list[StudyRow]:
    """Every study in the storage at ``url``, oldest first."""
    with closing(open_storage(url, create=False, read_only=True)) as storage:
        return [_row(storage, frozen.study_name) for frozen in storage.optuna.get_all_studies()]


def _row(storage: Storage, name: str) -> StudyRow:
    study = optuna.load_study(study_name=name, storage=storage.optuna)
    ours = attrs.SPEC in study.user_attrs
    spec = studies.stored_spec(storage, name) if ours else None
    trials = warm_start.ran_here(study.get_trials(deepcopy=False))
    counted = Counter(t.state.name.lower() for t in trials)
    best = summary.best_trial(study)
    # A storage that only Optuna wrote has no worker registry: no worker of ours ever served it.
    has_registry = sqlalchemy.inspect(storage.db.engine).has_table(WorkerRecord.__tablename__)
    workers = liveness.list_workers(storage.db, name) if has_registry else []
    return StudyRow(
        name=name,
        states={s.name.lower(): counted[s.name.lower()] for s in TrialState},
        n_trials=budget.n_trials(study, spec) if spec is not None else None,
        metric=spec.search.quality if spec is not None else None,
        best_value=objectives.quality(best) if best is not None else None,
        live_workers=sum(w.state == "live" for w in workers),
    )


def format_rows(rows: list[StudyRow], storage_display: str) -> str:
    """A table: study, trials ended of the budget, by state, best value, live workers (columns as wide as needed)."""
    if not rows:
        return f"no studies in {storage_display}; create one with `hpsearch start --study NAME`"
    table: list[tuple[str, ...]] = [
        ("study", "ended", "complete", "pruned", "failed", "running", "waiting", "best", "live workers")
    ]
    for r in rows:
        st = r.states
        ended = st["complete"] + st["pruned"] + st["fail"]
        # A study hpsearch did not create has no budget: its trials are counted, against nothing.
        of = f"{ended} of {r.n_trials}" if r.n_trials is not None else f"{ended} (not hpsearch's)"
        best = f"{r.metric or 'value'} {summary.fmt(r.best_value)}" if r.best_value is not None else "-"
        counts = (st["complete"], st["pruned"], st["fail"], st["running"], st["waiting"])
        table.append((r.name, of, *map(str, counts), best, str(r.live_workers)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table)


def cmd_list(args: argparse.Namespace) -> int:
    url = urls.resolve(args.storage)
    rows = list_studies(url)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_rows(rows, urls.mask(url)))
    return ExitCode.OK
