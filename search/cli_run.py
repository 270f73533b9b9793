"""`hpsearch start` and `hpsearch worker`: check everything a search needs (the spec, the
storage, the study's folder, the data, the model, the devices) in one line each, then run
this host's workers and print the summary."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from contextlib import closing, suppress
from pathlib import Path

import optuna

from hpsearch.search import devices, stop_signals, study as studies, summary
from hpsearch.search.cli_study import format_status, study_status
from hpsearch.search.devices import Device, check_precision
from hpsearch.search.dispatch import Supervisor
from hpsearch.search.errors import UsageError
from hpsearch.search.exit_codes import ExitCode
from hpsearch.search.presets import PRESETS, preset_file, resolved
from hpsearch.search.search_config import MAX_TRIALS
from hpsearch.search.spec import StudySpec, load_file
from hpsearch.storage import rundir, trialdir, urls
from hpsearch.storage.errors import StorageError, StudyNotFoundError
from hpsearch.storage.open import Storage, open_storage
from hpsearch.trainer.adapters import check_quantization, check_targets
from hpsearch.trainer.config import ConfigError
from hpsearch.trainer.dataset import prepare, read_splits
from hpsearch.trainer.model import check_model, check_reachable, load_tokenizer

log = logging.getLogger("hpsearch")
TOKEN_CACHE = "token-cache"


def cmd_start(args: argparse.Namespace) -> int:
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
        rundir.check(study_dir, args.study, None, exists=False, storage=urls.mask(urls.normalize(url)))
    else:
        with closing(storage):
            _check_study(storage, args.study, spec, study_dir)
    _check_inputs(spec, args.output_dir, args.study, device_list)
    with closing(open_storage(url, create=True)) as storage:
        _check_study(storage, args.study, spec, study_dir)  # again: another host may have made it meanwhile
        study = studies.create_or_resume(storage, args.study, spec)
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
    on = ", ".join(d.label for d in device_list)
    log.info("study %s: %d trials on %s; storage %s", args.study, spec.search.n_trials, on, urls.mask(url))
    del study
    return _run_and_report(args, url, device_list)


def _check_study(storage: Storage, name: str, spec: StudySpec, study_dir: Path) -> None:
    """The spec matches the stored one, and the checkpoint folder is this study's (writes nothing)."""
    exists, uid = studies.check_spec_before_create(storage, name, spec)
    rundir.check(study_dir, name, uid, exists=exists, storage=storage.display)


def cmd_worker(args: argparse.Namespace) -> int:
    url = urls.resolve(args.storage)
    device_list = devices.parse(args.devices)
    study_dir = args.output_dir.resolve() / args.study
    with closing(open_storage(url, create=False)) as storage:
        spec = studies.stored_spec(storage, args.study)
        _check_study(storage, args.study, spec, study_dir)
        device_list = devices.group(device_list, spec.train.devices_per_trial, args.devices)
        _check_inputs(spec, args.output_dir, args.study, device_list)
        study = optuna.load_study(study_name=args.study, storage=storage.optuna)
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
    return _run_and_report(args, url, device_list)


def _run_and_report(args: argparse.Namespace, url: str, device_list: list[Device]) -> int:
    level = logging.DEBUG if args.verbose else logging.INFO
    supervisor = Supervisor(args.study, url, device_list, args.output_dir.resolve(), level)
    code = supervisor.run()
    lost = "the workers could not reach it while stopping" if supervisor.storage_lost else None
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


def _check_inputs(spec: StudySpec, output_dir: Path, study: str, device_list: list[Device]) -> None:
    """Check --output-dir, read the data, tokenizer and model config and check the precision against the devices
    before any worker starts: bad input is one clear line, not N failed trials."""
    # A folder that cannot be written, or a file where the workers make a folder, would crash every trial.
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        raise UsageError(
            f"--output-dir {output_dir}: cannot write there ({exc.strerror or exc}); choose a folder you can write to"
        ) from None
    for name in (study, TOKEN_CACHE):
        if (output_dir / name).exists() and not (output_dir / name).is_dir():
            raise UsageError(
                f"--output-dir {output_dir}: {output_dir / name} is a file, where hpsearch keeps a folder; "
                "move it away or choose another --output-dir"
            )
    spec = resolved(spec, output_dir)
    splits = read_splits(spec.data, spec.model.task)
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
    # Tokenised into the workers' own cache: what only tokenising finds (a causal-LM prompt
    # that leaves no token to train on) is reported here, and the workers reuse the result.
    prepare(spec.data, tokenizer, spec.model.max_length, output_dir / TOKEN_CACHE, spec.model.task, splits)
