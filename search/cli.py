"""The `hpsearch` command line: small commands that return exit codes, like optuna's CLI.

Heavy modules (torch, transformers, optuna) are imported inside the commands, so
`hpsearch --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hpsearch.search.errors import UsageError

log = logging.getLogger("hpsearch")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
TOKEN_CACHE = "token-cache"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other input error; the help is one flag away.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def study_name(value: str) -> str:
    """A study name is also a folder name under --output-dir: one path component, so two
    studies can never share (and overwrite) each other's checkpoints."""
    if not STUDY_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a study name: 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpsearch", description="Hyperparameter search for transformer fine-tunes.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def storage_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--storage",
            metavar="URL",
            help="postgresql://user:pass@host:5432/db or sqlite:///file.db "
            "(default: $HPSEARCH_STORAGE, else ./hpsearch.db)",
        )

    start = sub.add_parser("start", help="create or resume a study and run workers on this host's devices")
    start.add_argument(
        "--study", required=True, type=study_name, help="study name (built-in presets: bert-lr, gpt2-lr)"
    )
    start.add_argument(
        "--config", metavar="FILE", type=Path, help="study spec (.toml); default ./STUDY.toml or a preset"
    )
    _worker_args(start)
    start.add_argument("--n-trials", type=int, metavar="N", help="override the spec's search.n_trials budget")
    storage_arg(start)
    start.set_defaults(func=cmd_start)

    wk = sub.add_parser("worker", help="join an existing study with this host's devices")
    wk.add_argument("--study", required=True, type=study_name)
    _worker_args(wk)
    storage_arg(wk)
    wk.set_defaults(func=cmd_worker)

    st = sub.add_parser("status", help="trials by state, best trial, and every worker on every host")
    st.add_argument("--study", required=True)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument(
        "--all", action="store_true", help="a row for every trial (default: a long study shows its latest and best)"
    )
    st.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=10.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 10) until the search ends or Ctrl-C",
    )
    storage_arg(st)
    st.set_defaults(func=cmd_status)

    reap = sub.add_parser(
        "reap", help="fail and retry trials whose worker stopped sending heartbeats (host shut down, network cut)"
    )
    reap.add_argument("--study", required=True)
    reap.add_argument(
        "--grace",
        type=float,
        metavar="SECONDS",
        help="heartbeat age that counts as lost (default and least: 3 of each worker's own heartbeat interval, "
        "90 s at the default 30 s)",
    )
    storage_arg(reap)
    reap.set_defaults(func=cmd_reap)

    best = sub.add_parser("best", help="the best trial and its checkpoint path")
    best.add_argument("--study", required=True)
    best.add_argument("--json", action="store_true", help="machine-readable output")
    best.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="copy the best model and tokenizer to DIR (loadable with from_pretrained)",
    )
    best.add_argument(
        "--merge",
        action="store_true",
        help="with --export, for an adapter trial: export the base with the adapter merged in "
        "(loadable with plain from_pretrained, no peft)",
    )
    storage_arg(best)
    best.set_defaults(func=cmd_best)

    dash = sub.add_parser("dashboard", help="serve optuna-dashboard on the study's storage")
    dash.add_argument("--study", help="open this study's page (default: the list of studies)")
    storage_arg(dash)
    dash.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: reach it by SSH tunnel); any other address requires "
        "the token it prints, or $HPSEARCH_DASHBOARD_TOKEN",
    )
    dash.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0 = any free port)")
    dash.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer to this host name (a proxy's public name); repeatable. Others get 403",
    )
    mode = dash.add_mutually_exclusive_group()
    mode.add_argument(
        "--read-only",
        dest="writable",
        action="store_false",
        default=None,
        help="visitors browse only (the default off 127.0.0.1)",
    )
    mode.add_argument(
        "--writable",
        dest="writable",
        action="store_true",
        default=None,
        help="visitors may also edit notes and delete studies and trials (the default on 127.0.0.1)",
    )
    dash.set_defaults(func=cmd_dashboard)
    return parser


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", help="GPU indices (0,1) or cpu:N; default: every GPU, else one CPU worker")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=Path("hpsearch-runs"),
        metavar="DIR",
        help="where trial checkpoints go (DIR/STUDY/trial-N); default ./hpsearch-runs",
    )


def setup_logging(level: int, who: str) -> None:
    """The one log format of every hpsearch process: ``18:35:30 [who] INFO message``, where
    ``who`` is the command or the worker, so a terminal shared by a search's processes reads
    as one log. Optuna's own lines (its "[I 2026-...]" handler) go through the same format,
    at warning level unless debug logging was asked for."""
    import optuna

    logging.basicConfig(level=level, format=f"%(asctime)s [{who}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    optuna.logging.set_verbosity(logging.DEBUG if level <= logging.DEBUG else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO, args.command or "hpsearch")
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if _is_user_error(exc):
            print(f"hpsearch {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        from hpsearch.storage.errors import StorageError

        if isinstance(exc, StorageError):
            # Not the input's fault (the server went away, a disk filled): one line, no
            # traceback, and an exit code that does not blame the input.
            print(f"hpsearch {args.command}: error: {exc}", file=sys.stderr)
            return 1
        raise


def _is_user_error(exc: BaseException) -> bool:
    from hpsearch.search.devices import DeviceError
    from hpsearch.storage.errors import StorageUrlError, StudyFolderError, StudyNotFoundError
    from hpsearch.trainer.config import ConfigError
    from hpsearch.trainer.data import DataError
    from hpsearch.trainer.errors import ModelError

    return isinstance(
        exc,
        (
            UsageError,
            ConfigError,
            DataError,
            ModelError,
            DeviceError,
            StorageUrlError,
            StudyNotFoundError,
            StudyFolderError,
        ),
    )


# -- commands ---------------------------------------------------------------------------------


def cmd_start(args: argparse.Namespace) -> int:
    from hpsearch.search import devices, study as studies
    from hpsearch.search.search_config import MAX_TRIALS
    from hpsearch.storage import rundir, urls
    from hpsearch.storage.errors import StudyNotFoundError
    from hpsearch.storage.open import open_storage

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
    # The storage and the study's folder first: a wrong URL or a changed spec is said at once,
    # not after the data has been tokenised.
    try:
        storage = open_storage(url, create=False)
    except StudyNotFoundError:  # no storage yet: the study is new, and so must its folder be
        rundir.check(study_dir, args.study, None, exists=False, storage=urls.mask(urls.normalize(url)))
    else:
        try:
            _check_study(storage, args.study, spec, study_dir)
        finally:
            storage.close()
    _check_output_dir(args.output_dir, args.study)
    _check_inputs(spec, args.output_dir, device_list)
    storage = open_storage(url, create=True)
    try:
        _check_study(storage, args.study, spec, study_dir)  # again: another host may have made it meanwhile
        study = studies.create_or_resume(storage, args.study, spec)
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
    finally:
        storage.close()
    log.info(
        "study %s: %d trials on %s; storage %s",
        args.study,
        spec.search.n_trials,
        ", ".join(d.label for d in device_list),
        urls.mask(url),
    )
    del study
    return _run_and_report(args, url, device_list)


def _check_study(storage: Any, name: str, spec: Any, study_dir: Path) -> None:
    """The spec matches the stored one, and the checkpoint folder is this study's (writes nothing)."""
    from hpsearch.search import study as studies
    from hpsearch.storage import rundir

    exists, uid = studies.check_spec_before_create(storage, name, spec)
    rundir.check(study_dir, name, uid, exists=exists, storage=storage.display)


def cmd_worker(args: argparse.Namespace) -> int:
    import optuna

    from hpsearch.search import devices, study as studies
    from hpsearch.storage import rundir, urls
    from hpsearch.storage.open import open_storage

    url = urls.resolve(args.storage)
    device_list = devices.parse(args.devices)
    study_dir = args.output_dir.resolve() / args.study
    storage = open_storage(url, create=False)
    try:
        spec = studies.stored_spec(storage, args.study)
        _check_study(storage, args.study, spec, study_dir)
        device_list = devices.group(device_list, spec.train.devices_per_trial, args.devices)
        _check_output_dir(args.output_dir, args.study)
        _check_inputs(spec, args.output_dir, device_list)
        study = optuna.load_study(study_name=args.study, storage=storage.optuna)
        rundir.claim(study_dir, args.study, studies.ensure_uid(study), storage.display)
    finally:
        storage.close()
    return _run_and_report(args, url, device_list)


def _run_and_report(args: argparse.Namespace, url: str, device_list: list[Any]) -> int:
    from hpsearch.search import lifeline, summary
    from hpsearch.search.dispatch import Supervisor
    from hpsearch.storage.errors import StorageError

    level = logging.DEBUG if args.verbose else logging.INFO
    supervisor = Supervisor(args.study, url, device_list, args.output_dir.resolve(), level)
    code = supervisor.run()
    lost = "the workers could not reach it while stopping" if supervisor.storage_lost else None
    if lost is None:
        try:
            s = _status(args.study, url, best_only=False)
        except StorageError as exc:
            lost = lifeline.describe(exc)
    if lost is not None:
        # The workers are done (or stopped); only the summary is lost. Not the input's fault,
        # so never exit 2, and keep the supervisor's code (128 + signal after a stop).
        print(
            f"hpsearch {args.command}: the storage is unreachable, so no summary ({lost}); "
            f"interrupted trials resume from their checkpoints at the next `hpsearch {args.command}` once it is back",
            file=sys.stderr,
        )
        return code or 1
    print(_format(s, as_json=False, best_only=False))
    failure = summary.failed_only(s)
    if code == 0 and failure:
        # Exit 0 would tell a script that a search ran; nothing did.
        logs = args.output_dir / args.study / "trial-N" / "train.log"
        print(f"hpsearch {args.command}: error: {failure}; see {logs}", file=sys.stderr)
        return 1
    if code == 0 and summary.ended_without_best(s):
        # The search is over and left no model: a script going on to `best --export` must know.
        print(f"hpsearch {args.command}: error: {s['no_best'][0]}; the fix is above", file=sys.stderr)
        return EXIT_FAILED
    return code


def cmd_status(args: argparse.Namespace) -> int:
    import time

    from hpsearch.search import summary
    from hpsearch.storage import urls

    url = urls.resolve(args.storage)
    if args.watch is not None and not 0.5 <= args.watch < math.inf:
        raise UsageError(f"--watch {args.watch:g}: must be a number of seconds >= 0.5")
    while True:
        s = _status(args.study, url, best_only=False)
        text = _format(s, as_json=args.json, best_only=False, every=args.all)
        if args.watch is None:
            print(text)
            return EXIT_OK
        if sys.stdout.isatty():
            print("\x1b[H\x1b[J", end="")  # redraw in place
        print(text, flush=True)
        if summary.search_over(s):
            return EXIT_OK
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return EXIT_OK  # the way to stop watching, not a failure


def cmd_reap(args: argparse.Namespace) -> int:
    from hpsearch.search import reap, study as studies
    from hpsearch.storage import urls
    from hpsearch.storage.open import open_storage

    if args.grace is not None and not 0 <= args.grace < math.inf:  # also refuses nan
        raise UsageError(f"--grace {args.grace:g}: must be a number of seconds >= 0")
    storage = open_storage(urls.resolve(args.storage), create=False)
    try:
        spec = studies.stored_spec(storage, args.study)
        retries = spec.search.max_retries
        done = reap.reap_by_hand(storage, args.study, max_retries=retries, grace_s=args.grace)
    finally:
        storage.close()
    for r in done:
        outcome = "retry queued" if r.retried else "out of retries"
        print(f"trial {r.trial_number}: worker {r.worker} on {r.host} silent for {r.heartbeat_age_s:.0f}s; {outcome}")
    if not done:
        print("no stale trials")
    return EXIT_OK


def cmd_best(args: argparse.Namespace) -> int:
    from hpsearch.storage import urls

    if args.merge and args.export is None:
        raise UsageError("--merge: goes with --export DIR (the folder the merged model is written to)")
    status = _status(args.study, urls.resolve(args.storage), best_only=True)
    ended = status["finished"] + status["states"]["fail"]
    if status["best"] is None and ended == 0 and args.export is None:
        # Nothing has run yet: not a search that went wrong, and nothing to explain.
        print(_format(status, as_json=args.json, best_only=True))
        return EXIT_OK
    if status["best"] is None:
        # Said the same with and without --export: what happened, the best point, the fix.
        print(_format(status, as_json=args.json, best_only=True))
        nothing = "nothing to export" if args.export is not None else "no model to use"
        print(f"hpsearch best: error: study {args.study!r} has no complete trial; {nothing}", file=sys.stderr)
        return EXIT_FAILED
    if args.export is not None:
        from hpsearch.search.export import export_best

        export_best(status["best"], args.study, args.export.resolve(), status["uid"], merge=args.merge)
    print(_format(status, as_json=args.json, best_only=True))
    if args.export is not None and not args.json:
        print(f"exported to {args.export.resolve()}")
    return EXIT_OK


def cmd_dashboard(args: argparse.Namespace) -> int:
    from hpsearch.search import dashboard
    from hpsearch.storage import urls

    try:
        return dashboard.run(
            urls.resolve(args.storage),
            args.study,
            args.host,
            args.port,
            allow_hosts=args.allow_host,
            writable=args.writable,
        )
    except dashboard.DashboardError as exc:
        raise UsageError(str(exc)) from None


def _status(name: str, url: str, *, best_only: bool) -> dict[str, Any]:
    import optuna

    from hpsearch.search import fleet, study as studies, summary
    from hpsearch.storage import lost
    from hpsearch.storage.open import open_storage

    storage = open_storage(url, create=False, read_only=True)
    try:
        spec = studies.stored_spec(storage, name)
        study = optuna.load_study(study_name=name, storage=storage.optuna)
        s = summary.status(study, spec, studies.n_trials(study, spec), storage.display)
        s["uid"] = study.user_attrs.get(studies.UID_ATTR)  # whose checkpoint folder is whose
        if not best_only:
            s.update(fleet.summary(storage.db, name))
            summary.mark_stale(s, lost.stale_trials(storage.db, name))
    finally:
        storage.close()
    return s


def _format(s: dict[str, Any], *, as_json: bool, best_only: bool, every: bool = False) -> str:
    from hpsearch.search import fleet, summary

    if best_only:
        return json.dumps(s["best"], indent=2) if as_json else summary.format_best(s)
    if as_json:
        return json.dumps(s, indent=2)
    return "\n".join([summary.format_status(s), summary.format_trials(s, every=every), fleet.format_workers(s)])


# -- helpers ----------------------------------------------------------------------------------


def _spec_for_start(args: argparse.Namespace, url: str) -> Any:
    """--config, else ./STUDY.toml, else the stored spec of an existing study, else a preset."""
    from hpsearch.search import presets, spec as specs, study as studies
    from hpsearch.storage.errors import StudyNotFoundError
    from hpsearch.storage.open import open_storage

    if args.config is not None:
        return specs.load_file(args.config)
    local = Path(f"{args.study}.toml")
    if local.is_file():
        return specs.load_file(local)
    try:
        storage = open_storage(url, create=False)
    except StudyNotFoundError:
        storage = None
    if storage is not None:
        try:
            return studies.stored_spec(storage, args.study)
        except StudyNotFoundError:
            pass
        finally:
            storage.close()
    preset = presets.preset_file(args.study)
    if preset is not None:
        return specs.load_file(preset)
    raise UsageError(
        f"study {args.study!r} does not exist and has no spec; pass --config FILE, put {args.study}.toml "
        f"here, or use a preset ({', '.join(presets.PRESETS)})"
    )


def _check_inputs(spec: Any, output_dir: Path, device_list: list[Any]) -> None:
    """Read the data, the tokenizer and the model's config once before any worker starts (and
    before storage is touched), and check the precision against the devices, so bad input is
    one clear line, not N failed trials."""
    from hpsearch.search.devices import check_precision
    from hpsearch.search.presets import resolved
    from hpsearch.trainer.config import ConfigError
    from hpsearch.trainer.dataset import prepare, read_splits
    from hpsearch.trainer.model import check_model, check_reachable, load_tokenizer

    spec = resolved(spec, output_dir)
    splits = read_splits(spec.data, spec.model.task)
    check_reachable(spec.model.name)
    tokenizer = load_tokenizer(spec.model.name)
    check_model(spec.model.name, spec.model.max_length)
    from hpsearch.trainer.adapters import check_quantization, check_targets

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


def _check_output_dir(output_dir: Path, study: str) -> None:
    """--output-dir is a folder this user can write, and the folders the workers make in it
    (the study's, the token cache) are not taken by files: else every trial would crash."""
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


def run() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    run()
