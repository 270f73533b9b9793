"""What `status` and `best` show, as plain data: a study's trials by state, its best trial, why it has none, and its
workers (status_text.py prints it)."""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.study import objectives, warm_start
from hpsearch.search.study.money import Price
from hpsearch.search.study.spec import StudySpec
from hpsearch.storage import attrs, deletions, ledger, liveness, retention
from hpsearch.storage.db import Database
from hpsearch.trainer.report import FailReason

SHOWN = (
    attrs.BEST_STEP,
    attrs.BEST_CHECKPOINT,
    attrs.BEST_CHECKPOINT_DELETED,  # why the folder best_checkpoint names is gone; None while it is there
    attrs.BEST_CHECKPOINT_MB,
    attrs.HOST,
    attrs.DEVICE,
    attrs.WORKER,
    attrs.THREADS,
    attrs.HELD,
    attrs.SPEED,
    attrs.FAIL_REASON,
    attrs.RETRY_OF,
)


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The complete trial ranked first as retention ranks them: by value, then by its best point's validation
    loss (docs/decisions.md, "A tie goes to the lower validation loss"); Optuna's breaks ties by number. In a
    two-objective study, the Pareto front's trial of the best quality objective."""
    if objectives.is_multi(study):
        complete = objectives.front(study)
    else:
        finished = warm_start.ran_here(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        complete = [t for t in finished if t.value is not None]
    if not complete:
        return None
    minimize = study.directions[0] == optuna.study.StudyDirection.MINIMIZE

    def key(t: FrozenTrial) -> tuple[float, float, int]:
        return retention.rank(t.values[0], retention.recorded_loss(t.user_attrs), t.number, minimize=minimize)

    return min(complete, key=key)


def failed(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that failed for good: failed, and not handed back for a retry (a trial stopped or crashed and
    queued again was stopped, not broken: its retry is counted in its own state). The one failed count: `status`,
    the live line, the study note and the end of `start` show these."""
    retried = {t.user_attrs.get(attrs.RETRY_OF) for t in trials}
    return [t for t in trials if t.state == TrialState.FAIL and t.number not in retried]


def trial_dict(trial: FrozenTrial, study_attrs: Mapping[str, Any], now: dt.datetime | None = None) -> dict[str, Any]:
    """What status and best show of ``trial``; ``study_attrs``: its study's user attributes, where the deletion
    of its checkpoints is recorded (storage/deletions.py)."""
    start, end = trial.datetime_start, trial.datetime_complete or now or dt.datetime.now()
    seen = deletions.attributes(trial, study_attrs)
    return {
        "number": trial.number,
        "state": trial.state.name,
        "value": objectives.quality(trial),
        "cost": objectives.cost(trial),  # a two-objective study's second objective
        "params": trial.params,
        "step": max(objectives.points(trial), default=None),
        "duration_s": max(0.0, (end - start).total_seconds()) if start else None,
        # The trial's attributes that status and best show, under their own keys.
        **{key: seen.get(key) for key in SHOWN},
    }


def status(study: optuna.Study, spec: StudySpec, n_trials: int, storage_display: str) -> dict[str, Any]:
    trials = warm_start.ran_here(study.get_trials(deepcopy=False))
    states = Counter(t.state.name.lower() for t in trials)
    best = best_trial(study)
    now, study_attrs = dt.datetime.now(), study.user_attrs
    return {
        "study": study.study_name,
        "storage": storage_display,
        "metric": spec.search.quality,
        "cost_objective": spec.search.cost,
        "direction": spec.direction,
        "n_trials": n_trials,
        "finished": states["complete"] + states["pruned"],
        "states": {s.name.lower(): states[s.name.lower()] for s in TrialState},
        "failed": [t.number for t in failed(trials)],  # for good; states["fail"] counts the handed-back too
        "best": trial_dict(best, study_attrs) if best else None,
        "front": [trial_dict(t, study_attrs) for t in objectives.front(study)],
        "trials": [trial_dict(t, study_attrs, now) for t in trials],
        "no_best": None if best else why_no_best(study, spec),
    }


def add_money(db: Database, study: str, spec: StudySpec, s: dict[str, Any]) -> None:
    """Put into ``s`` (``status``'s) what the study and each of its trials cost so far: the ledger's device time
    (storage/ledger.py) at the spec's price (search/study/money.py); None without a price."""
    price = Price.of_search(spec.search)
    if price is None:
        s["money"] = None
        return
    used, each = ledger.device_time(db, study), ledger.by_trial(db, study)
    s["money"] = {"spent": price.of(used.seconds), "currency": price.currency, "price_per_gpu_hour": price.per_hour}
    s["money"]["device_time"] = used.text(4)
    for trial in [*s["trials"], *s["front"], *([s["best"]] if s["best"] else [])]:
        trial["money"] = price.of(each.get(trial["number"], 0.0))


BY_PRUNER = "by the pruner"  # a pruned trial that records no reason


def reason(trial: dict[str, Any]) -> str:
    """Why a trial ended as it did, in a few words ("" for complete and running trials); a failed one's record as it
    is (its detail says which error, or what became of the trial)."""
    if trial["state"] == "PRUNED":
        why = FailReason.of(trial[attrs.FAIL_REASON])
        return why.text if why else trial[attrs.FAIL_REASON] or BY_PRUNER
    if trial["state"] == "FAIL":
        return str(trial[attrs.FAIL_REASON] or "no reason recorded")
    return ""


def why_no_best(study: optuna.Study, spec: StudySpec) -> list[str]:
    """What to tell a user whose study has no complete trial: what ended the trials, the best
    point any of them reached, and what to change. Empty while no trial has ended."""
    trials, study_attrs = study.get_trials(deepcopy=False), study.user_attrs
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    broken = failed(trials)
    if not pruned and not broken:
        return []
    causes = Counter(reason(trial_dict(t, study_attrs)) for t in pruned)
    said = ", ".join(f"{n} {cause}" for cause, n in causes.most_common())
    lines = [f"no trial completed: {len(pruned)} pruned ({said})" if pruned else "no trial completed"]
    if broken:
        lines[0] += f", {len(broken)} failed"
    points = [
        (t, step, v) for t in trials for step, v in objectives.points(t).items() if v is not None and math.isfinite(v)
    ]
    point = (min if spec.direction == "minimize" else max)(points, key=lambda p: p[2], default=None)
    if point is not None:
        trial, step, value = point
        seen = deletions.attributes(trial, study_attrs)
        kept = seen.get(attrs.BEST_CHECKPOINT) and not deletions.deleted_why(seen)
        where = f"checkpoint {seen[attrs.BEST_CHECKPOINT]}" if kept else "no checkpoint kept"
        lines.append(
            f"best point reached: trial {trial.number}, {spec.search.quality} {value:.4f} at step {step} ({where})"
        )
    lines += [f"fix: {fix}" for fix in _fixes(causes, spec)]
    return lines


def _fixes(causes: Counter[str], spec: StudySpec) -> list[str]:
    s, t = spec.search, spec.train
    lr = spec.space.get("learning_rate")
    if lr is not None and lr.choices:
        lr_now = f"now one of {', '.join(map(fmt, lr.choices))}"
    elif lr is not None:
        lr_now = f"now {lr.low:g} to {lr.high:g}"
    else:
        lr_now = f"now fixed at train.learning_rate = {t.learning_rate:g}"
    fixes = []
    if causes[FailReason.AT_CHANCE.text]:
        fixes.append(
            f"the models did no better than guessing the label prior: train longer before they are judged "
            f"(train.eval_every, now {t.eval_every}; train.epochs or max_steps), move the learning-rate range "
            f"(search.space.learning_rate, {lr_now}), or set search.prune_at_chance = 0 to let them run"
        )
    if causes[FailReason.NAN_LOSS.text]:
        fixes.append(
            f"the loss became NaN: lower the learning rate (search.space.learning_rate, {lr_now}), keep "
            f'train.max_grad_norm > 0, or use train.precision = "fp32"'
        )
    if causes[BY_PRUNER]:
        fixes.append(
            f"the {s.pruner} pruner stopped them before any finished: judge later (search.pruner_min_resource or "
            f'pruner_warmup_steps, train.eval_every, now {t.eval_every}) or set search.pruner = "none"'
        )
    if not fixes:  # failures only: their reasons are in the table of `hpsearch status`
        fixes.append("read why each trial failed (hpsearch status) and a trial's train.log")
    return fixes


def failed_only(s: dict[str, Any]) -> str | None:
    """The most common failure reason when the study has failed trials and no other; None otherwise."""
    st, broken = s["states"], set(s["failed"])
    if not broken or st["complete"] or st["pruned"] or st["running"] or st["waiting"]:
        return None
    cause, count = Counter(reason(t) for t in s["trials"] if t["number"] in broken).most_common(1)[0]
    return f"every trial failed ({len(broken)}); {count} with: {cause}"


def search_over(s: dict[str, Any]) -> bool:
    """No trial runs or waits, and the budget is used (or the rest failed)."""
    st = s["states"]
    return not st["running"] and not st["waiting"] and s["finished"] + len(s["failed"]) >= s["n_trials"]


def ended_without_best(s: dict[str, Any]) -> bool:
    """Trials ended, none completed, and none runs or waits: the search left no model."""
    st = s["states"]
    return s["best"] is None and bool(s.get("no_best")) and not st["running"] and not st["waiting"]


def mark_stale(s: dict[str, Any], stale: list[liveness.StaleTrial]) -> None:
    """Flag running trials whose worker stopped beating: they wait for a reaper."""
    numbers = {t.trial_number for t in stale}
    for trial in s["trials"]:
        trial["stale"] = trial["state"] == "RUNNING" and trial["number"] in numbers
    s["stale_trials"] = sorted(t["number"] for t in s["trials"] if t["stale"])


def mark_stopped(s: dict[str, Any], signal_name: str, resume: str) -> None:
    """Record that this host's search was stopped (Ctrl-C, SIGTERM): which trials wait to resume, and the command
    that resumes them. A handed-back trial counts as failed in Optuna's states, but it was stopped, not broken."""
    trials = s["trials"]
    waiting = sorted(t[attrs.RETRY_OF] for t in trials if t["state"] == "WAITING" and t[attrs.RETRY_OF] is not None)
    s["stopped"] = {"signal": signal_name, "waiting_to_resume": waiting, "resume": resume}


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def workers(db: Database, study: str) -> dict[str, Any]:
    """What `status` shows about the workers of ``study`` (who runs what, where, how long), as plain data."""
    found, used = liveness.list_workers(db, study), ledger.device_time(db, study)
    return {
        "workers": [asdict(w) for w in found],
        "workers_by_state": {state: sum(w.state == state for w in found) for state in ("live", "lost", "finished")},
        # The study's device time (storage/ledger.py device_time): hours by unit, and as every view shows it.
        "device_hours": {unit: seconds / 3600 for unit, seconds in used.by_unit.items()},
        "device_time": used.text(3),
    }


def memory_held(trials: list[dict[str, Any]], plan: Any) -> str | None:
    """The memory plan's figures beside what the trials really held (``Figures.held_mb``): a wrong plan shows after
    one trial. On CUDA the peak allocation is set beside the plan's total; on CPU, where only the tensors' own
    bytes are measured, beside its weights, gradients and optimizer state. None before any trial measured itself."""
    held = [
        (t[attrs.HELD], t["number"], t.get(attrs.DEVICE)) for t in trials if isinstance(t.get(attrs.HELD), (int, float))
    ]
    if not held:
        return None
    most, number, device = max(held, key=lambda h: h[0])
    line = f"memory: trial {number} held {_size(most * 2**20)}"
    if not isinstance(plan, dict) or not all(
        isinstance(plan.get(k), int) for k in ("total", "weights", "gradients", "optimizer")
    ):
        return line
    if str(device or "").startswith("cuda"):
        return f"{line} at its peak; planned {_size(plan['total'])} per device (the spec's largest micro-batch)"
    states = plan["weights"] + plan["gradients"] + plan["optimizer"]
    return f"{line} of weights, gradients and optimizer state; planned {_size(states)}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
