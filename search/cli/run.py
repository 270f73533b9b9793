"""`hpsearch start` and `hpsearch worker`: check everything a search needs (the spec, the
storage, the study's folder, the data, the model, the devices) in one line each, then run
this host's workers and print the summary."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import tempfile
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hpsearch.search.cli.detach import checks_passed
from hpsearch.search.cli.main import DEFAULT_OUTPUT_DIR
from hpsearch.search.cli.study_commands import format_status, study_status
from hpsearch.search.errors import USER_ERRORS, UsageError
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.presets import BUILTIN_DIR, PRESETS, preset_file, resolved, resolved_data
from hpsearch.search.study import budget, plan as plans, studies, warm_start
from hpsearch.search.study.search_config import MAX_TRIALS
from hpsearch.search.study.spec import StudySpec, load_file
from hpsearch.search.views import summary
from hpsearch.search.workers import devices, retry, stop_signals
from hpsearch.search.workers.devices import Device, check_precision
from hpsearch.search.workers.dispatch import Supervisor
from hpsearch.storage import attrs, rundir, slots, trialdir, urls
from hpsearch.storage.errors import StorageError, StudyNotFoundError
from hpsearch.storage.open import Storage, check_creatable, open_storage
from hpsearch.trainer.adapters import check_quantization, check_targets
from hpsearch.trainer.config import ConfigError
from hpsearch.trainer.encoding import keep, left_out, prepare
from hpsearch.trainer.model import check_model, check_reachable, load_tokenizer
from hpsearch.trainer.sources import names
from hpsearch.trainer.splits import read_splits
from hpsearch.trainer.tokenised import Prepared

log = logging.getLogger("hpsearch")
TOKEN_CACHE = "token-cache"


def cmd_start(args: argparse.Namespace) -> int:
    try:
        return _start(args)
    except studies.DamagedSpecError:
        # Nothing runs on a spec a database writer changed; but the study's trials are what they are, and a start
        # whose search had ended shows them, as it would have, above the one line that says why it stops here.
        _summary_of_damaged(args)
        raise


def _summary_of_damaged(args: argparse.Namespace) -> None:
    with suppress(StorageError, *USER_ERRORS):
        s = study_status(args.study, urls.resolve(args.storage), best_only=False)
        if s["finished"] or any(s["states"].values()):
            print(format_status(s, as_json=False, best_only=False))


def _start(args: argparse.Namespace) -> int:
    if args.n_trials is not None and args.n_trials < 1:
        raise UsageError(f"--n-trials {args.n_trials}: must be >= 1")
    if args.n_trials is not None and args.n_trials > MAX_TRIALS:
        raise UsageError(f"--n-trials {args.n_trials}: must be at most {MAX_TRIALS:,}, a search that can end")
    url = urls.resolve(args.storage)
    urls.normalize(url)  # a malformed URL fails here, before anything else
    device_list = devices.parse(args.devices)
    spec = _spec_for_start(args, url)
    if args.n_trials is not None:
        spec.search.n_trials = args.n_trials
    device_list = devices.group(device_list, spec.train.devices_per_trial, args.devices)
    study_dir = args.output_dir.resolve() / args.study
    # The storage and the study's folder first: a wrong URL or a changed spec is said before tokenising the data.
    try:
        storage = open_storage(url, create=False)
    except StudyNotFoundError:  # no storage yet: the study is new, and so must its folder be
        check_creatable(url)  # else the inputs would be read (and checked) for a storage that cannot be made
        rundir.check(study_dir, args.study, None, exists=False, storage=urls.mask(urls.normalize(url)))
        exists = False
    else:
        with closing(storage):
            exists = _check_study(storage, args.study, spec, study_dir)
    # Read now, before anything is written: a warm start is applied only as the study is created.
    warm = None if exists else warm_start.plan(spec, args.study, url)
    inputs = _check_inputs(spec, args.output_dir, args.study, device_list)
    # Before anything is paid for: a trial far bigger than a device is refused here (exit 2), nothing written.
    plan = plans.check(inputs.spec, device_list)
    # Every check passed: only now is anything written (the storage, the study, its folder, the token cache).
    with closing(open_storage(url, create=True)) as storage:
        _check_study(storage, args.study, spec, study_dir)  # again: another host may have made it meanwhile
        for line in spec.defaults_added:
            log.info("%s", line)
        study = studies.create_or_resume(storage, args.study, spec, warm)
        if plan is not None:
            study.set_user_attr(attrs.MEMORY_PLAN, plan.record())  # `status` shows it
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
        used = _budget_used(storage, study, spec)
    inputs.keep()
    checks_passed()  # a caller that detached this search (hpsearch.start(wait=False)) may return now
    if used is not None:
        return _nothing_to_run(args, url, used)
    on = ", ".join(d.label for d in device_list)
    log.info("study %s: %d trials on %s; storage %s", args.study, spec.search.n_trials, on, urls.mask(url))
    del study
    return _run_and_report(args, url, device_list, spec)


def _check_study(storage: Storage, name: str, spec: StudySpec, study_dir: Path) -> bool:
    """The spec matches the stored one, and the checkpoint folder is this study's (writes nothing); whether the
    study exists."""
    exists, uid = studies.check_spec_before_create(storage, name, spec)
    rundir.check(study_dir, name, uid, exists=exists, storage=storage.display)
    return exists


def cmd_worker(args: argparse.Namespace) -> int:
    url = urls.resolve(args.storage)
    device_list = devices.parse(args.devices)
    study_dir = args.output_dir.resolve() / args.study
    with closing(open_storage(url, create=False)) as storage:
        # Read and checked once, here: the workers run this spec, and never read the stored one again (a database
        # writer may change it; docs/decisions.md, "A worker runs the spec it was started with").
        spec = studies.stored_spec(storage, args.study)
        _check_study(storage, args.study, spec, study_dir)
        device_list = devices.group(device_list, spec.train.devices_per_trial, args.devices)
        inputs = _check_inputs(spec, args.output_dir, args.study, device_list)
        plan = plans.check(inputs.spec, device_list)  # against this host's devices, before its first trial
        storage.prepare()  # tables an older hpsearch did not make (the device-time ledger's), before workers use them
        study = optuna.load_study(study_name=args.study, storage=storage.optuna)
        if plan is not None:
            study.set_user_attr(attrs.MEMORY_PLAN, plan.record())
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
        used = _budget_used(storage, study, spec)
    inputs.keep()
    if used is not None:
        return _nothing_to_run(args, url, used)
    return _run_and_report(args, url, device_list, spec)


def _budget_used(storage: Storage, study: optuna.Study, spec: StudySpec) -> str | None:
    """Why no worker has anything to do (the budget is used and no trial runs or waits for a retry), or None.
    Starting workers anyway cost a model load and a few seconds before each found out for itself."""
    if study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        return None  # its worker may be gone: a worker started here reaps and retries it
    why = budget.budget_left(storage, study, spec, storage.db.now())
    if why is not None:
        return None if retry.waiting_retries(study) else why
    n_trials = budget.n_trials(study, spec)
    if slots.used_slots(storage.db, study.study_name) >= n_trials:
        return f"its budget of {n_trials} trials is used; raise it with --n-trials (more than {n_trials})"
    return None


def _nothing_to_run(args: argparse.Namespace, url: str, why: str) -> int:
    print(f"hpsearch {args.command}: study {args.study}: nothing to run, {why}", file=sys.stderr)
    return _report(args, url, ExitCode.OK)


def _run_and_report(args: argparse.Namespace, url: str, device_list: list[Device], spec: StudySpec) -> int:
    level = logging.DEBUG if args.verbose else logging.INFO
    supervisor = Supervisor(args.study, url, device_list, args.output_dir.resolve(), spec, level)
    return _report(args, url, supervisor.run(), storage_lost=supervisor.storage_lost)


def _report(args: argparse.Namespace, url: str, code: int, *, storage_lost: bool = False) -> int:
    """Print the study's summary after this host's workers ended with ``code``; the command's exit code."""
    lost = "the workers could not reach it while stopping" if storage_lost else None
    if lost is None:
        try:
            s = study_status(args.study, url, best_only=False)
        except StorageError as exc:
            lost = stop_signals.describe(exc)
    if lost is not None:
        # The workers are done (or stopped); only the summary is lost. Not the input's fault,
        # so never exit 2, and keep the supervisor's code (128 + signal after a stop).
        print(
            f"hpsearch {args.command}: the storage is unreachable, so no summary ({lost}); "
            f"interrupted trials resume from their checkpoints at the next `hpsearch {args.command}` once it is back",
            file=sys.stderr,
        )
        return code or ExitCode.FAILED
    if code in STOPPED:
        summary.mark_stopped(s, STOPPED[code], resume_command(args))
    print(format_status(s, as_json=False, best_only=False))
    failure = summary.failed_only(s)
    if code == 0 and failure:
        # Exit 0 would tell a script that a search ran; nothing did.
        logs = args.output_dir / args.study / "trial-N" / trialdir.LOG
        print(f"hpsearch {args.command}: error: {failure}; see {logs}", file=sys.stderr)
        return ExitCode.FAILED
    if code == 0 and summary.ended_without_best(s):
        # The search is over and left no model: a script going on to `best --export` must know.
        print(f"hpsearch {args.command}: error: {s['no_best'][0]}; the fix is above", file=sys.stderr)
        return ExitCode.FAILED
    return code


STOPPED = {ExitCode.signalled(sig): sig.name for sig in (signal.SIGINT, signal.SIGTERM)}
"""The supervisor's exit codes after a stop, and the signal each stands for."""


def resume_command(args: argparse.Namespace) -> str:
    """The command that resumes this search: the options given to this one, repeated (the spec is stored, so it
    would resume without --config too). A password in --storage is shown masked: it belongs in ~/.pgpass or
    PGPASSWORD, and this line may be pasted anywhere."""
    words = ["hpsearch", args.command, "--study", args.study]
    if getattr(args, "config", None) is not None:
        words += ["--config", str(args.config)]
    if getattr(args, "n_trials", None) is not None:
        words += ["--n-trials", str(args.n_trials)]
    if args.devices is not None:
        words += ["--devices", args.devices]
    if args.output_dir != DEFAULT_OUTPUT_DIR:
        words += ["--output-dir", str(args.output_dir)]
    if args.storage is not None:
        words += ["--storage", urls.mask(args.storage)]
    return shlex.join(words)


def _spec_for_start(args: argparse.Namespace, url: str) -> StudySpec:
    """--config, else ./STUDY.toml, else the stored spec of an existing study, else a preset."""
    if args.config is not None:
        return load_file(args.config)
    local = Path(f"{args.study}.toml")
    if local.is_file():
        return load_file(local)
    # StudyNotFoundError: no storage yet, or no such study in it.
    with suppress(StudyNotFoundError), closing(open_storage(url, create=False)) as storage:
        return studies.stored_spec(storage, args.study)
    preset = preset_file(args.study)
    if preset is not None:
        return load_file(preset)
    raise UsageError(
        f"study {args.study!r} does not exist and has no spec; pass --config FILE, put {args.study}.toml "
        f"here, or use a preset ({', '.join(PRESETS)})"
    )


@dataclass
class Inputs:
    """What `start` and `worker` read and checked, and the token cache they write once the study exists."""

    spec: StudySpec  # pkg:// and builtin:// turned into this host's paths
    tokenizer: Any
    prepared: Prepared
    cache: Path

    def keep(self) -> None:
        """Write the token cache, and say what the workers read (a stored spec is a database row)."""
        data, model = self.spec.data, self.spec.model
        keep(self.prepared, data, self.tokenizer, model.max_length, self.cache)
        log.info("the workers read: model %s; data %s (train) and %s (validation)", model.name, *names(data))


def _check_inputs(spec: StudySpec, output_dir: Path, study: str, device_list: list[Device]) -> Inputs:
    """Check --output-dir, read the data, tokenizer and model config and check the precision against the devices
    before any worker starts: bad input is one clear line, not N failed trials. Writes nothing but a built-in model
    (``builtin://``, built from hpsearch's own code once per host)."""
    _check_output_dir(output_dir, study)
    splits = read_splits(resolved_data(spec.data), spec.model.task)
    spec = resolved(spec, output_dir)
    check_reachable(spec.model.name)
    tokenizer = load_tokenizer(spec.model.name)
    check_model(spec.model.name, spec.model.max_length)
    check_targets(spec.model, spec.adapter)
    check_quantization(spec.model, [d.kind for d in device_list])
    check_precision(spec.train.precision, device_list)
    searched = spec.space.get("precision")
    for choice in searched.choices or [] if searched is not None else []:
        try:
            check_precision(choice, device_list)
        except ConfigError as exc:
            raise UsageError(f"search.space.precision: choice {choice!r}: {exc}") from None
    # Tokenised now: what only tokenising finds (a causal-LM prompt that leaves no token to train on) is reported
    # here. Into the workers' own cache once the study exists (Inputs.keep), where they find it.
    cache = output_dir.resolve() / TOKEN_CACHE  # as the workers name it: built from the folder resolved at start
    prepared = prepare(spec.data, tokenizer, spec.model.max_length, cache, spec.model.task, splits, write=False)
    for line in left_out(prepared, spec.data, spec.model.max_length):
        log.warning("%s", line)
    return Inputs(spec, tokenizer, prepared, cache)


def _check_output_dir(output_dir: Path, study: str) -> None:
    """A folder that cannot be written, or a file or link where the workers make a folder, would crash every trial;
    checked without creating anything (a refused `start` leaves no empty folder behind)."""
    existing = output_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        why = None if existing.is_dir() else f"{existing} is a file"
        if why is None:
            with tempfile.TemporaryFile(dir=existing):
                pass
    except OSError as exc:
        why = exc.strerror or str(exc)
    if why is not None:
        raise UsageError(f"--output-dir {output_dir}: cannot write there ({why}); choose a folder you can write to")
    for name in (study, TOKEN_CACHE, BUILTIN_DIR):
        path = output_dir / name
        if path.is_symlink() and name != study:  # the study's folder: rundir.check said so already
            raise UsageError(
                f"--output-dir {output_dir}: {path} is a link (to {os.readlink(path)}), where hpsearch keeps a "
                "folder it writes into, and it writes through no link; remove it or choose another --output-dir"
            )
        if path.exists() and not path.is_dir():
            raise UsageError(
                f"--output-dir {output_dir}: {path} is a file, where hpsearch keeps a folder; "
                "move it away or choose another --output-dir"
            )
