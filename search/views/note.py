"""The study note optuna-dashboard shows on a study's page (spec, budget used, best checkpoint), written with its
``save_note``. It depends only on finished trials, so it is written when it changes, not on every poll of every host."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpsearch.search.study.spec import StudySpec
from hpsearch.search.views import summary
from hpsearch.search.views.summary import fmt
from hpsearch.storage import attrs, ledger
from hpsearch.trainer.sources import names

log = logging.getLogger(__name__)


def render(study: optuna.Study, spec: StudySpec, n_trials: int, used: ledger.DeviceTime) -> str:
    """The note's markdown; a pure function of the study's finished trials, its spec and the device time used
    (the ledger's, storage/ledger.py ``device_time``)."""
    s = summary.status(study, spec, n_trials, "")
    st = s["states"]
    lines = [
        f"## hpsearch study `{study.study_name}`",
        "",
        f"**Budget:** {s['finished']} of {n_trials} trials finished ({st['complete']} complete, "
        f"{st['pruned']} pruned), {len(s['failed'])} failed; {used.text()} used.",
        "",
    ]
    lines += _best(s["best"], spec)
    lines += ["", "### Spec", "", *_spec_table(spec), "", *_space_table(spec), ""]
    lines.append("_Written by hpsearch as trials finish; edits made here are replaced at the next update._")
    return "\n".join(lines)


def _best(best: dict[str, Any] | None, spec: StudySpec) -> list[str]:
    if best is None:
        return ["**Best:** no complete trial yet."]
    params = ", ".join(f"`{k}` = {fmt(v)}" for k, v in sorted(best["params"].items()))
    step, host = best[attrs.BEST_STEP], best.get(attrs.HOST)
    lines = [
        f"**Best:** trial {best['number']}: {spec.search.quality} **{best['value']:.4f}** at step {step}",
        "",
        f"- checkpoint: `{best[attrs.BEST_CHECKPOINT]}`"
        + (f" on host `{host}`" if host else "")
        + (f" (deleted: {best[attrs.BEST_CHECKPOINT_DELETED]})" if best.get(attrs.BEST_CHECKPOINT_DELETED) else ""),
    ]
    if params:
        lines.append(f"- parameters: {params}")
    if best.get(attrs.SPEED) is not None:
        lines.append(f"- {best[attrs.SPEED]} samples/s on {best.get(attrs.DEVICE) or '?'}")
    return lines


def _spec_table(spec: StudySpec) -> list[str]:
    t, s = spec.train, spec.search
    judged = " and ".join(f"{m} ({d})" for m, d in zip(s.objectives, spec.directions, strict=True))
    steps = f", max {t.max_steps} steps" if t.max_steps else ""
    train = f"batch {t.batch_size} (micro {t.micro_batch_size}), {t.epochs} epoch{'' if t.epochs == 1 else 's'}{steps}"
    rows = [
        ("model", f"`{spec.model.name}` (max_length {spec.model.max_length})"),
        ("data", "train `{}`, validation `{}`".format(*names(spec.data))),
        ("train", f"{train}, eval every {t.eval_every} steps, precision {t.precision}"),
        ("search", f"{s.sampler} sampler, {s.pruner} pruner, {judged}, seed {s.seed}"),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _space_table(spec: StudySpec) -> list[str]:
    rows = ["| searched | range |", "|---|---|"]
    for name, p in spec.space.items():
        if p.type == "categorical":
            rng = ", ".join(fmt(c) for c in p.choices or [])
        else:
            rng = (
                f"{fmt(p.low)} to {fmt(p.high)}"
                + (" (log)" if p.log else "")
                + (f" step {fmt(p.step)}" if p.step else "")
            )
        rows.append(f"| `{name}` | {p.type}: {rng} |")
    return rows if spec.space else []


def update(study: optuna.Study, spec: StudySpec, n_trials: int, used: ledger.DeviceTime) -> None:
    """Write the note if its text changed."""
    notes = _dashboard_notes()
    body = render(study, spec, n_trials, used)
    if notes.get_note(study) != body:
        notes.save_note(study, body)
        log.debug("study note of %s updated", study.study_name)


@cache
def _dashboard_notes() -> ModuleType:
    """optuna-dashboard's note functions (``get_note``, ``save_note``). Its package imports the whole web app on the
    way, and with it scikit-learn (about 1.5 s of CPU in every `start`, which writes the note, and again in every
    test that starts one); the module that holds them needs only optuna, so it is loaded alone. Should a release
    move it, the package's own import is the fallback."""
    package = importlib.util.find_spec("optuna_dashboard")  # finds it without importing it
    origin = package.origin if package else None
    location = origin and importlib.util.spec_from_file_location(
        "hpsearch._dashboard_note", Path(origin).with_name("_note.py")
    )
    if location and location.loader:
        module = importlib.util.module_from_spec(location)
        try:
            location.loader.exec_module(module)
        except (OSError, ImportError):
            pass
        else:
            if callable(getattr(module, "save_note", None)) and callable(getattr(module, "get_note", None)):
                return module
    import optuna_dashboard

    return optuna_dashboard


def finished_key(trials: Iterable[FrozenTrial]) -> tuple[int, ...]:
    """Changes exactly when a trial finishes (or a retry is queued): when the note may change."""
    return tuple(
        sorted(t.number for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    )
