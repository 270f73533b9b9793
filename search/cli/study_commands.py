"""The commands on a study that runs or ran: status and best read it (never write it), reap
fails and retries the trials of a lost host, dashboard serves it."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import closing, suppress
from typing import Any

import optuna

from hpsearch.search.errors import UsageError
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.study import budget, studies
from hpsearch.search.views import dashboard, status_text, summary
from hpsearch.search.workers import reap
from hpsearch.storage import attrs, liveness, urls
from hpsearch.storage.open import open_storage


def cmd_status(args: argparse.Namespace) -> int:
    url = urls.resolve(args.storage)
    if args.watch is not None and not 0.5 <= args.watch < math.inf:
        raise UsageError(f"--watch {args.watch:g}: must be a number of seconds >= 0.5")
    said_damaged = False
    while True:
        s = study_status(args.study, url, best_only=False)
        if not said_damaged:
            said_damaged = say_damaged(args, s)
        text = format_status(s, as_json=args.json, best_only=False, every=args.all)
        if args.watch is None:
            print(text)
            return ExitCode.OK
        if sys.stdout.isatty():
            print("\x1b[H\x1b[J", end="")  # redraw in place
        print(text, flush=True)
        if summary.search_over(s):
            return ExitCode.OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return ExitCode.OK  # the way to stop watching, not a failure


def cmd_best(args: argparse.Namespace) -> int:
    if args.merge and args.export is None:
        raise UsageError("--merge: goes with --export DIR (the folder the merged model is written to)")
    status = study_status(args.study, urls.resolve(args.storage), best_only=True)
    say_damaged(args, status)
    if status["best"] is None:
        # Said the same with and without --export: what happened, the best point, the fix.
        print(format_status(status, as_json=args.json, best_only=True))
        if status["finished"] + status["states"]["fail"] == 0 and args.export is None:
            return ExitCode.OK  # nothing has run yet: not a search that went wrong
        nothing = "nothing to export" if args.export is not None else "no model to use"
        print(f"hpsearch best: error: study {args.study!r} has no complete trial; {nothing}", file=sys.stderr)
        return ExitCode.FAILED
    if args.export is not None:
        from hpsearch.search.views.export import export_best  # torch: only when a model is exported

        export_best(status["best"], args.study, args.export.resolve(), status["uid"], merge=args.merge)
    print(format_status(status, as_json=args.json, best_only=True))
    if args.export is not None and not args.json:
        print(f"exported to {args.export.resolve()}")
    return ExitCode.OK


def cmd_reap(args: argparse.Namespace) -> int:
    if args.grace is not None and not 0 <= args.grace < math.inf:  # also refuses nan
        raise UsageError(f"--grace {args.grace:g}: must be a number of seconds >= 0")
    with closing(open_storage(urls.resolve(args.storage), create=False)) as storage:
        spec, damaged = studies.readable_spec(storage, args.study)
        if damaged is not None:
            # Reaping frees the trials of a lost host, which a damaged spec does not change: the retry count is
            # the stored one where it reads, else the default.
            print(f"hpsearch reap: warning: {damaged}", file=sys.stderr)
        retries = spec.search.max_retries
        done = reap.by_hand(storage, args.study, max_retries=retries, grace_s=args.grace)
    for r in done:
        outcome = "retry queued" if r.retried else "out of retries"
        print(f"trial {r.trial_number}: worker {r.worker} on {r.host} silent for {r.heartbeat_age_s:.0f}s; {outcome}")
    if not done:
        print("no stale trials")
    return ExitCode.OK


def cmd_dashboard(args: argparse.Namespace) -> int:
    url = urls.resolve(args.storage)
    dash = dashboard.create(url, args.study, args.host, args.port, allow_hosts=args.allow_host, writable=args.writable)
    print(dashboard.how_to_reach(dash, args.host, args.study, urls.mask(url)), flush=True)
    with suppress(KeyboardInterrupt):  # Ctrl-C is how a dashboard ends
        dash.serve_forever()
    return ExitCode.OK


def study_status(name: str, url: str, *, best_only: bool) -> dict[str, Any]:
    """The study's summary (summary.status), its folder's uid, and unless ``best_only`` its workers."""
    with closing(open_storage(url, create=False, read_only=True)) as storage:
        spec, damaged = studies.readable_spec(storage, name)
        study = optuna.load_study(study_name=name, storage=storage.optuna)
        s = summary.status(study, spec, budget.n_trials(study, spec), storage.display)
        s["damaged_spec"] = damaged
        s["uid"] = study.user_attrs.get(attrs.UID)  # whose checkpoint folder is whose
        plan = study.user_attrs.get(attrs.MEMORY_PLAN)
        s["memory_plan"] = plan.get("line") if isinstance(plan, dict) else None
        s["memory_held"] = summary.memory_held(s["trials"], plan)
        summary.add_money(storage.db, name, spec, s)
        if not best_only:
            s.update(summary.workers(storage.db, name))
            summary.mark_stale(s, liveness.stale_trials(storage.db, name))
    return s


def say_damaged(args: argparse.Namespace, s: dict[str, Any]) -> bool:
    """Say, in one line on stderr (stdout stays the status, or its JSON), that the study's stored spec is damaged and
    what is shown is what could be read; whether it was."""
    if s.get("damaged_spec"):
        print(f"hpsearch {args.command}: warning: {s['damaged_spec']}", file=sys.stderr)
    return bool(s.get("damaged_spec"))


def format_status(s: dict[str, Any], *, as_json: bool, best_only: bool, every: bool = False) -> str:
    """``study_status`` as text or JSON: the best trial only, or the status, trials and workers."""
    if best_only:
        if as_json:
            # The best trial as before; a two-objective study's front and a priced study's cost beside it.
            extra = {key: s[k] for key, k in (("pareto_front", "front"), ("study_money", "money")) if s.get(k)}
            return json.dumps(s["best"] | extra if s["best"] and extra else s["best"], indent=2)
        return status_text.format_best(s)
    if as_json:
        return json.dumps(s, indent=2)
    return "\n".join(
        [status_text.format_status(s), status_text.format_trials(s, every=every), status_text.format_workers(s)]
    )
