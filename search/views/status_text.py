"""How `status`, `best` and the end of `start` print a study: the lines and tables drawn from summary.py's dicts."""

from __future__ import annotations

from typing import Any

from hpsearch.search.study.money import Price
from hpsearch.search.views.summary import fmt, reason
from hpsearch.storage import attrs, ledger, registry
from hpsearch.storage.shown import shown
from hpsearch.trainer.reading import short

CELL, PATH = 40, 300
"""Characters of a table cell or a name read from a row, and of a path: beyond that, a row is cut (storage/shown.py)."""
LATEST_ROWS, BEST_ROWS = 20, 3
"""Rows of a long study's trial table without --all: the latest trials, and the best ones."""


def _format_stopped(stopped: dict[str, Any]) -> list[str]:
    waiting = stopped["waiting_to_resume"]
    if waiting:
        which = f"trial{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))}"
        held = f"{which} {'were' if len(waiting) > 1 else 'was'} handed back and wait{'' if len(waiting) > 1 else 's'}"
        held += " to resume from its last resumable state" if len(waiting) == 1 else " to resume from their states"
    else:
        held = "no trial waits to resume"
    return [f"stopped: the search was stopped ({stopped['signal']}); {held}", f"  resume with: {stopped['resume']}"]


def format_status(s: dict[str, Any]) -> str:
    st = s["states"]
    lines = [
        f"study {s['study']}  ({s['storage']})",
        f"trials: {s['finished']}/{s['n_trials']} finished  complete {st['complete']}  pruned {st['pruned']}  "
        f"failed {len(s['failed'])}  running {st['running']}  waiting {st['waiting']}",
    ]
    if s.get("memory_plan"):
        lines.append(s["memory_plan"])
    if s.get("memory_held"):
        lines.append(s["memory_held"])
    if s.get("stopped"):
        lines += _format_stopped(s["stopped"])
    if s.get("stale_trials"):
        numbers = ", ".join(map(str, s["stale_trials"]))
        lines.append(
            f"stale: trial {numbers} (its worker stopped sending heartbeats); any running worker retries it, "
            f"or run: hpsearch reap --study {s['study']}"
        )
    lines += format_best(s).splitlines()
    return "\n".join(lines)


def format_best(s: dict[str, Any]) -> str:
    """The best trial (in a two-objective study: the Pareto front's best quality, then the front), and what the
    study cost where the spec gives a price."""
    lines = _format_best(s).splitlines()
    if s.get("front"):
        lines += _format_front(s)
    if s.get("money"):
        lines.append(_format_money(s))
    return "\n".join(lines)


def _format_best(s: dict[str, Any]) -> str:
    best, metric = s["best"], s["metric"]
    if best is None:
        if s.get("stopped"):  # the failures why_no_best counts are the trials handed back: no fix to give
            return "best: none yet; no trial completed before the stop"
        if not s.get("no_best"):
            return "best: no complete trial yet"
        first, *rest = s["no_best"]
        return "\n".join([f"best: none; {first}", *(f"  {line}" for line in rest)])
    lines = [f"best: trial {best['number']}  {metric} {best['value']:.4f} at step {best[attrs.BEST_STEP]}"]
    if best.get("cost") is not None:
        lines[0] += f"  {s['cost_objective']} {fmt(best['cost'])}"
    # Names, values, paths and hosts are rows: escaped (a newline would forge a line, an escape sequence reach the
    # terminal) and cut.
    lines += [f"  {shown(k)} = {shown(fmt(v))}" for k, v in sorted(best["params"].items())]
    lines.append(f"  checkpoint: {checkpoint_text(best, size=True)}")
    host = best.get(attrs.HOST)
    if host and host != registry.this_host():
        lines.append(f"  warning: the checkpoint lives on host {shown(host)}, not on this host")
    return "\n".join(lines)


def checkpoint_text(trial: dict[str, Any], *, size: bool = False) -> str:
    """A trial's best checkpoint as status shows it: its path (escaped: a row's word), with its size or, once its
    folder is gone, why."""
    path, gone = trial.get(attrs.BEST_CHECKPOINT), trial.get(attrs.BEST_CHECKPOINT_DELETED)
    if not path:
        return "no checkpoint" + (f" (deleted: {shown(gone)})" if gone else "")
    if gone:
        return f"{shown(path, PATH)} (deleted: {shown(gone)})"
    mb = trial.get(attrs.BEST_CHECKPOINT_MB)
    return shown(path, PATH) + (f" ({mb:.1f} MiB)" if size and isinstance(mb, int | float) else "")


def _format_front(s: dict[str, Any]) -> list[str]:
    """The Pareto front, one line a trial: no trial is better on both objectives than any of these."""
    front, metric, cost = s["front"], s["metric"], s["cost_objective"]
    lines = [f"pareto front ({metric} and {cost}): {len(front)} trial{'s' if len(front) != 1 else ''}"]
    for t in front:
        where = checkpoint_text(t)
        money = f"  {_price(s).text(t['money'])}" if t.get("money") is not None else ""
        lines.append(f"  trial {t['number']}  {metric} {t['value']:.4f}  {cost} {fmt(t['cost'])}{money}  {where}")
    return lines


def _price(s: dict[str, Any]) -> Price:
    return Price(s["money"]["price_per_gpu_hour"], s["money"]["currency"])


def _format_money(s: dict[str, Any]) -> str:
    """What the study cost so far, and its best trial."""
    m, price = s["money"], _price(s)
    hours = f"{m['device_time']} at {price.text(m['price_per_gpu_hour'])} a device-hour"
    line = f"spent: {price.text(m['spent'])} so far ({hours})"
    if s["best"] is not None and s["best"].get("money") is not None:
        line += f"; the best trial {price.text(s['best']['money'])}"
    return line


def format_trials(s: dict[str, Any], *, every: bool = False) -> str:
    """One row per trial: number, state, value, step reached, searched parameters, duration, worker, and why a
    pruned or failed trial ended. Without ``every``, a long study shows its latest and best trials only."""
    trials = s["trials"]
    if not trials:
        return "no trials yet"
    listed = trials
    if not every and len(trials) > LATEST_ROWS + BEST_ROWS:
        minimize = s["direction"] == "minimize"
        ranked = sorted(
            (t for t in trials if t["state"] == "COMPLETE" and t["value"] is not None),
            key=lambda t: t["value"] if minimize else -t["value"],
        )
        keep = {t["number"] for t in ranked[:BEST_ROWS]} | {t["number"] for t in trials[-LATEST_ROWS:]}
        listed = [t for t in trials if t["number"] in keep]
    names = sorted({k for t in trials for k in t["params"]})
    cost, money = s.get("cost_objective"), s.get("money")
    header = ["#", "state", s["metric"], *([cost] if cost else []), "step", *(shown(n, CELL) for n in names), "time"]
    header += [*([money["currency"] or "money"] if money else []), "threads", "worker", "reason"]
    rows = [header]
    for t in listed:
        rows.append(
            [
                str(t["number"]),
                t["state"].lower() + (" (stale)" if t.get("stale") else ""),
                f"{t['value']:.4f}" if t["value"] is not None else "-",
                *([fmt(t["cost"]) if t["cost"] is not None else "-"] if cost else []),
                str(t["step"]) if t["step"] is not None else "-",
                *(shown(fmt(t["params"][n]), CELL) if n in t["params"] else "-" for n in names),
                duration(t["duration_s"]),
                *([Price.number(t["money"]) if t.get("money") is not None else "-"] if money else []),
                str(t.get(attrs.THREADS) or "-"),
                shown(t[attrs.WORKER] or "-", CELL),
                shown(short(" ".join(reason(t).split()), 60)),  # a traceback's last line may hold newlines
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if len(listed) < len(trials):
        hidden = len(trials) - len(listed)
        lines.append(f"({hidden} more trials not shown, only the latest and the best; --all shows every one)")
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def format_workers(s: dict[str, Any]) -> str:
    by = s["workers_by_state"]
    lines = [f"workers: {by['live']} live, {by['lost']} lost, {by['finished']} finished  {s['device_time']}"]
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
            doing = f"no heartbeat for {_age(w['heartbeat_age_s'])}" + (
                f" (was on trial {w['current_trial']})" if w["current_trial"] is not None else ""
            )
        lines.append(
            f"  {w['state']:<8} {shown(w['host'], CELL):<20} {shown(w['device'], CELL):<8} "
            f"pid {w['pid']:<7} {doing:<24} "
            f"trials {w['trials_finished']:<4} {w['device_seconds'] / 3600:.3f} {ledger.unit(w['device'])}"
        )
    return "\n".join(lines)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"
