"""hpsearch from Python (``import hpsearch``): a ``Search`` watches, stops and uses a study that runs or ran (the
calls that make one are in python_api/start.py).

Every call goes through the CLI's own code: status and trials are `status`'s data
(cli/study_commands.py `study_status`), ``export``/``load_best`` export.py's checked checkpoint, ``stop`` the SIGTERM
a terminal's Ctrl-C would send. Bad input is an ``HpsearchError`` whose text is the one line the CLI prints."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import warnings
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpsearch.search.cli.study_commands import format_status, study_status
from hpsearch.search.python_api.errors import InputError, SearchError, raised_as_hpsearch_errors
from hpsearch.search.views import summary
from hpsearch.storage import attrs, registry, urls

POLL_S = 5.0
"""How often ``wait`` reads the study: a read of a few rows, cheap beside a trial."""
NO_WORKER_GRACE_S = 90.0
"""How long ``wait`` waits for a search that no process runs before it says so: a worker registers only after it
has imported torch (seconds), and a killed one stays live in the registry for 3 heartbeats (90 s at the default)."""
PLOTS = {
    "history": "plot_optimization_history",
    "intermediate": "plot_intermediate_values",
    "parallel": "plot_parallel_coordinate",
    "importances": "plot_param_importances",
    "pareto": "plot_pareto_front",
}
"""``Search.plot``'s kinds and Optuna's plotly functions that draw them."""
NOTEBOOK_EXTRA = "pip install 'hpsearch[notebook]'"


@dataclass(frozen=True)
class Best:
    """The best trial, ranked as `hpsearch best` ranks them."""

    number: int
    value: float | None
    params: dict[str, Any]
    metrics: dict[str, float]
    """Its validation metrics at its best point (loss, accuracy, ...)."""
    step: int | None
    """The optimizer step of its best point: the checkpoint's."""
    checkpoint: Path | None
    """Its model folder (``from_pretrained`` loads it), once shown to be what hpsearch wrote for this study on this
    host; None otherwise, and ``no_checkpoint`` says why."""
    no_checkpoint: str | None = None


@dataclass(frozen=True)
class Status:
    """What `hpsearch status` says, as data; ``str()`` is its text."""

    study: str
    storage: str
    metric: str
    direction: str
    n_trials: int
    states: dict[str, int]
    """Trials by state: complete, pruned, fail, running, waiting."""
    finished: int
    """Complete and pruned trials."""
    best: Best | None
    live_workers: int
    over: bool
    """No trial runs or waits and the budget is used: ``wait`` returns."""
    no_best: list[str] = field(default_factory=list)
    """Why no trial completed, and what to change (empty while one did, or none ended yet)."""
    text: str = field(default="", repr=False)

    def __str__(self) -> str:
        return self.text


class Search:
    """A study in a storage: the one ``start`` ran, or the one ``load`` found. Holds no connection: every call
    reads the storage anew, so a ``Search`` lives as long as a notebook likes."""

    def __init__(self, study: str, storage_url: str, *, pid: int | None = None, log: Path | None = None) -> None:
        self.study = study
        self._url = storage_url
        self._pid = pid  # the detached `hpsearch start` this process ran, if it did
        self.log = log
        """The detached search's output (``STUDY_DIR/search.log``) when this process started it."""

    def __repr__(self) -> str:
        return f"Search(study={self.study!r}, storage={urls.mask(self._url)!r})"

    def _read(self, *, best_only: bool = False) -> dict[str, Any]:
        with raised_as_hpsearch_errors(self._url):
            return study_status(self.study, self._url, best_only=best_only)

    def status(self) -> Status:
        return self._status(self._read())

    def _status(self, s: dict[str, Any]) -> Status:
        return Status(
            study=s["study"],
            storage=s["storage"],
            metric=s["metric"],
            direction=s["direction"],
            n_trials=s["n_trials"],
            states=dict(s["states"]),
            finished=s["finished"],
            best=self._best(s),
            live_workers=s["workers_by_state"]["live"],
            over=summary.search_over(s),
            no_best=list(s["no_best"] or []),
            text=format_status(s, as_json=False, best_only=False),
        )

    @property
    def best(self) -> Best | None:
        """The best trial so far, None before one completed."""
        return self._best(self._read(best_only=True))

    def _best(self, s: dict[str, Any]) -> Best | None:
        best = s["best"]
        if best is None:
            return None
        from hpsearch.search.views.export import ExportError, checked_checkpoint  # torch: only once there is a model

        try:
            checkpoint, no_checkpoint = checked_checkpoint(best, self.study, s["uid"])[0], None
        except ExportError as exc:
            checkpoint, no_checkpoint = None, str(exc)
        return Best(
            number=best["number"],
            value=best["value"],
            params=dict(best["params"]),
            metrics=self._metrics(best["number"]),
            step=best.get(attrs.BEST_STEP),
            checkpoint=checkpoint,
            no_checkpoint=no_checkpoint,
        )

    def _metrics(self, number: int) -> dict[str, float]:
        import optuna

        from hpsearch.storage.open import open_storage

        with raised_as_hpsearch_errors(self._url), closing(open_storage(self._url, create=False, read_only=True)) as st:
            study = optuna.load_study(study_name=self.study, storage=st.optuna)
            user_attrs = study.trials[number].user_attrs
        prefix = attrs.BEST_VAL
        return {k.removeprefix(prefix): v for k, v in user_attrs.items() if k.startswith(prefix)}

    def trials(self) -> Any:
        """Every trial as a pandas DataFrame: number, state, value, cost (a second objective), one ``params_NAME``
        column per searched parameter, step, duration_s, checkpoint (a Path; None once deleted), checkpoint_deleted
        (why it was deleted, None while it is there), device_hours,
        money (None without a price), fail_reason, retry_of, host, device."""
        try:
            import pandas as pd
        except ImportError:
            raise InputError(f"Search.trials() returns a pandas DataFrame: {NOTEBOOK_EXTRA}") from None
        s = self._read()
        seconds = self._device_seconds()
        rows = []
        for t in s["trials"]:
            recorded, gone = t.get(attrs.BEST_CHECKPOINT), t.get(attrs.BEST_CHECKPOINT_DELETED)
            rows.append(
                {
                    "number": t["number"],
                    "state": t["state"],
                    "value": t["value"],
                    "cost": t["cost"],
                    **{f"params_{name}": value for name, value in t["params"].items()},
                    "step": t["step"],
                    "duration_s": t["duration_s"],
                    # A path to load, or None: a deleted one's path is no model, and checkpoint_deleted says why.
                    "checkpoint": Path(recorded) if recorded and not gone else None,
                    "checkpoint_deleted": gone,
                    "device_hours": seconds.get(t["number"], 0.0) / 3600,
                    "money": t.get("money"),
                    "fail_reason": summary.reason(t) or None,
                    "retry_of": t.get(attrs.RETRY_OF),
                    "host": t.get(attrs.HOST),
                    "device": t.get(attrs.DEVICE),
                }
            )
        return pd.DataFrame(rows)

    def _device_seconds(self) -> dict[int, float]:
        from hpsearch.storage import ledger
        from hpsearch.storage.open import open_storage

        with raised_as_hpsearch_errors(self._url), closing(open_storage(self._url, create=False, read_only=True)) as st:
            return ledger.by_trial(st.db, self.study)

    def load_best(self) -> tuple[Any, Any]:
        """The best trial's model (a peft model for an adapter study) and tokenizer, in eval mode, ready to
        predict; from its checked checkpoint (``best.checkpoint``)."""
        from hpsearch.search.views.export import checked_checkpoint
        from hpsearch.trainer import adapters
        from hpsearch.trainer.checkpoint import META
        from hpsearch.trainer.model import from_pretrained, load_tokenizer

        s = self._read(best_only=True)
        with raised_as_hpsearch_errors(self._url):
            source, folder = checked_checkpoint(s["best"], self.study, s["uid"])
            with folder.reading():  # held against retention while it loads
                tokenizer = load_tokenizer(str(source))
                if (source / adapters.ADAPTER_CONFIG).exists():
                    meta = json.loads((source / META).read_text()) if (source / META).is_file() else {}
                    labels = meta.get("id2label") if isinstance(meta, dict) else None
                    model = adapters.load_saved(source, len(labels) if isinstance(labels, dict) else None)
                else:
                    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

                    config = from_pretrained(AutoConfig, str(source))
                    causal = any(a.endswith("ForCausalLM") for a in config.architectures or [])
                    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
                    model = from_pretrained(auto, str(source))
        return model.eval(), tokenizer

    def export(self, path: str | os.PathLike[str], merge: bool = False) -> Path:
        """`hpsearch best --export PATH [--merge]`: a checked copy of the best model that ``from_pretrained``
        loads; the folder written."""
        from hpsearch.search.views.export import export_best

        s = self._read(best_only=True)
        with raised_as_hpsearch_errors(self._url):
            return export_best(s["best"], self.study, Path(path).resolve(), s["uid"], merge=merge)

    def wait(self, timeout: float | None = None, progress: bool = True) -> Status:
        """Until the search is over (every trial of its budget ended) or ``timeout`` seconds passed; the status
        then (``over`` says which). ``progress``: a bar of finished trials (a widget in a notebook with ipywidgets,
        text elsewhere). A search that no process runs any more raises ``SearchError`` instead of waiting forever."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _ProgressBar(self.study) if progress else None
        quiet_since: float | None = None
        try:
            while True:
                s = self._read()
                if bar is not None:
                    bar.show(s)
                if summary.search_over(s):
                    return self._status(s)
                if s["workers_by_state"]["live"] or self._running_here():
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > NO_WORKER_GRACE_S:
                    raise SearchError(self._nobody_runs_it(s))
                if deadline is not None and time.monotonic() >= deadline:
                    return self._status(s)
                pause = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
                time.sleep(pause)
        finally:
            if bar is not None:
                bar.close()

    def _nobody_runs_it(self, s: dict[str, Any]) -> str:
        ended = s["finished"] + s["states"]["fail"]
        return (
            f"study {self.study!r} is not over ({ended} of {s['n_trials']} trials ended) and no worker runs it; "
            f"resume it with hpsearch.start({self.study!r}) or `hpsearch worker --study {self.study}`"
        )

    def stop(self, wait: bool = True, timeout: float = 300.0) -> Status:
        """Stop this host's `hpsearch start`/`worker` processes of the study as SIGTERM does: each running trial
        hands back its resumable state and waits to resume at the next start. With ``wait``, until they ended."""
        s = self._read()
        here = self._processes_here(s)
        if not here:
            elsewhere = sorted({w["host"] for w in s["workers"] if w["state"] == "live"} - {registry.this_host()})
            where = f"; its workers run on {', '.join(elsewhere)}: stop them there" if elsewhere else ""
            raise SearchError(f"study {self.study!r}: no hpsearch process of it runs on this host{where}")
        for pid in here:
            with suppress(ProcessLookupError):  # ended since it was found: nothing left to stop
                os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        while wait and any(_runs_study(pid, self.study) for pid in here):
            if time.monotonic() >= end:
                raise SearchError(
                    f"study {self.study!r}: hpsearch process(es) {', '.join(map(str, here))} still run "
                    f"{timeout:g} s after SIGTERM (a trial saving its state?); call stop() again to wait longer"
                )
            time.sleep(0.5)
        return self.status()

    def _running_here(self) -> bool:
        return self._pid is not None and _runs_study(self._pid, self.study)

    def _processes_here(self, s: dict[str, Any]) -> list[int]:
        """The `hpsearch start`/`worker` processes (the supervisors) of this study on this host: the parents of its
        live workers in the registry, and the one this ``Search`` started. A pid is a row's word (or an old one
        reused): each is signalled only if its command line is hpsearch's for this study."""
        host = registry.this_host()
        found = {_parent(w["pid"]) for w in s["workers"] if w["state"] == "live" and w["host"] == host}
        found.add(self._pid)
        return sorted(pid for pid in found if pid is not None and _runs_study(pid, self.study))

    def plot(self, kind: str = "history") -> Any:
        """Optuna's plotly figure of the study: ``history``, ``intermediate`` (each trial's validation points),
        ``parallel`` (parallel coordinates), ``importances`` (of the parameters) or ``pareto`` (a two-objective
        study's front)."""
        import optuna

        from hpsearch.search.study import objectives
        from hpsearch.storage.open import open_storage

        if kind not in PLOTS:
            raise InputError(f"plot kind {kind!r}: one of {', '.join(PLOTS)}")
        try:
            import plotly  # noqa: F401  # Optuna's figures are plotly's
        except ImportError:
            raise InputError(f"Search.plot() draws with plotly: {NOTEBOOK_EXTRA}") from None
        draw = getattr(optuna.visualization, PLOTS[kind])
        with raised_as_hpsearch_errors(self._url), closing(open_storage(self._url, create=False, read_only=True)) as st:
            study = optuna.load_study(study_name=self.study, storage=st.optuna)
            multi = objectives.is_multi(study)
            if kind == "pareto" and not multi:
                raise InputError(f"plot kind 'pareto': study {self.study!r} has one objective, so no Pareto front")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                if multi and kind not in ("pareto", "intermediate"):
                    return draw(study, target=lambda t: t.values[0], target_name=(study.metric_names or ["value"])[0])
                return draw(study)


class _ProgressBar:
    """Finished trials of the budget, with the best value: tqdm's notebook widget where ipywidgets is installed,
    its text bar elsewhere (a terminal, or a notebook without the widget)."""

    def __init__(self, study: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tqdm.auto warns where it falls back to text: that is fine here
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=study, unit="trial", total=None)

    def show(self, s: dict[str, Any]) -> None:
        self.bar.total = s["n_trials"]
        self.bar.n = s["finished"] + s["states"]["fail"]
        best = s["best"]
        running = s["states"]["running"]
        best_text = f"{s['metric']} {summary.fmt(best['value'])}" if best else "-"
        self.bar.set_postfix_str(f"running {running}, best {best_text}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _runs_study(pid: int, study: str) -> bool:
    """Whether process ``pid`` of this host is `hpsearch start|worker --study STUDY` (console script or -m)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":  # ended, not yet reaped by its parent
        return False
    is_cli = any(a.endswith(("/hpsearch", "hpsearch.search.cli.main")) or a == "hpsearch" for a in argv[:3])
    command = next((a for a in argv[1:] if a in ("start", "worker")), None)
    named = any(a == "--study" and b == study for a, b in itertools.pairwise(argv))
    return is_cli and command is not None and (named or f"--study={study}" in argv)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
