"""What `status` and `best` show: a study's trials by state and its best trial."""

from __future__ import annotations

from collections import Counter
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.spec import StudySpec
from hpsearch.storage import checkpoints as retention, registry


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The complete trial ranked first the way checkpoint retention ranks them: by value, then,
    at an equal value, by the validation loss of its best point. Optuna's own ``study.best_trial``
    (and the dashboard's) breaks such ties by trial number alone."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not complete:
        return None
    minimize = study.direction == optuna.study.StudyDirection.MINIMIZE
    return min(
        complete,
        key=lambda t: retention.rank(t.value, retention.recorded_loss(t.user_attrs), t.number, minimize=minimize),
    )


def trial_dict(trial: FrozenTrial) -> dict[str, Any]:
    attrs = trial.user_attrs
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": trial.value,
        "params": trial.params,
        "best_step": attrs.get("best_step"),
        "best_checkpoint": attrs.get("best_checkpoint"),
        "host": attrs.get("host"),
        "device": attrs.get("device"),
        "worker": attrs.get("worker"),
        "train_samples_per_second": attrs.get("train_samples_per_second"),
        "fail_reason": attrs.get("fail_reason"),
    }


def status(study: optuna.Study, spec: StudySpec, n_trials: int, storage_display: str) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    states = Counter(t.state.name.lower() for t in trials)
    best = best_trial(study)
    return {
        "study": study.study_name,
        "storage": storage_display,
        "metric": spec.search.metric,
        "direction": spec.direction,
        "n_trials": n_trials,
        "finished": states["complete"] + states["pruned"],
        "states": {s.name.lower(): states[s.name.lower()] for s in TrialState},
        "best": trial_dict(best) if best else None,
        "trials": [trial_dict(t) for t in trials],
    }


def failed_only(s: dict[str, Any]) -> str | None:
    """What to say when the study has failed trials and nothing else (no complete, pruned or
    running one): its most common failure reason; None otherwise."""
    st = s["states"]
    if not st["fail"] or st["complete"] or st["pruned"] or st["running"] or st["waiting"]:
        return None
    reasons = Counter(t["fail_reason"] or "no reason recorded" for t in s["trials"] if t["state"] == "FAIL")
    reason, count = reasons.most_common(1)[0]
    return f"every trial failed ({st['fail']}); {count} with: {reason}"


def mark_stale(s: dict[str, Any], stale: list[registry.StaleTrial]) -> None:
    """Flag running trials whose worker stopped beating: they wait for a reaper."""
    numbers = {t.trial_number for t in stale}
    for trial in s["trials"]:
        trial["stale"] = trial["state"] == "RUNNING" and trial["number"] in numbers
    s["stale_trials"] = sorted(t["number"] for t in s["trials"] if t["stale"])


def format_status(s: dict[str, Any]) -> str:
    st = s["states"]
    lines = [
        f"study {s['study']}  ({s['storage']})",
        f"trials: {s['finished']}/{s['n_trials']} finished  complete {st['complete']}  pruned {st['pruned']}  "
        f"failed {st['fail']}  running {st['running']}  waiting {st['waiting']}",
    ]
    if s.get("stale_trials"):
        numbers = ", ".join(map(str, s["stale_trials"]))
        lines.append(
            f"stale: trial {numbers} (its worker stopped sending heartbeats); any running worker retries it, "
            f"or run: hpsearch reap --study {s['study']}"
        )
    lines += format_best(s["best"], s["metric"]).splitlines()
    return "\n".join(lines)


def format_best(best: dict[str, Any] | None, metric: str) -> str:
    if best is None:
        return "best: no complete trial yet"
    lines = [f"best: trial {best['number']}  {metric} {best['value']:.4f} at step {best['best_step']}"]
    lines += [f"  {k} = {_fmt(v)}" for k, v in sorted(best["params"].items())]
    lines.append(f"  checkpoint: {best['best_checkpoint']}")
    host = best.get("host")
    if host and host != registry.this_host():
        lines.append(f"  warning: the checkpoint lives on host {host}, not on this host")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
