"""The `hpsearch` command line: its parser, and how a command's end becomes an exit code. Each command is a
small ``cmd_<command>`` in cli/run.py (start, worker) or cli/study_commands.py (status, best, reap, dashboard), imported
when it runs, as are optuna and the error classes, so that `hpsearch --help` answers at once."""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from hpsearch.search.exit_codes import ExitCode


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(f"hpsearch.search.{module}"), f"cmd_{name}")(args))

    return command


cmd_start, cmd_worker = _command("cli.run", "start"), _command("cli.run", "worker")
cmd_status, cmd_best = _command("cli.study_commands", "status"), _command("cli.study_commands", "best")
cmd_reap, cmd_dashboard = _command("cli.study_commands", "reap"), _command("cli.study_commands", "dashboard")
cmd_plan = _command("cli.plan_command", "plan")
cmd_list = _command("cli.list_command", "list")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other input error; the help is one flag away.
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def study_name(value: str) -> str:
    """Also a folder name under --output-dir: one path component, so two studies never share checkpoints."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a study name: 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def device_list(value: str) -> str:
    """--devices as typed (devices.py reads it); an empty one is a mistake (an unset variable in a script), not
    a request for the default, which is what leaving the flag out means."""
    if not value.strip():
        raise argparse.ArgumentTypeError(
            f"{value!r} names no device; give GPU indices (0,1) or cpu:N, or leave --devices out for every GPU"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpsearch", description="Hyperparameter search for transformer fine-tunes.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"hpsearch {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def storage_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--storage",
            metavar="URL",
            help="postgresql://user@host:5432/db (the password in ~/.pgpass or $PGPASSWORD, not in the URL: ps shows "
            "it) or sqlite:///file.db (default: $HPSEARCH_STORAGE, else ./hpsearch.db)",
        )

    start = sub.add_parser("start", help="create or resume a study and run workers on this host's devices")
    start.add_argument(
        "--study", required=True, type=study_name, help="study name (built-in presets: bert-lr, gpt2-lr, lora-chat)"
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

    pl = sub.add_parser("plan", help="the memory a trial needs per device, and what would make it fit")
    pl.add_argument("--study", required=True, type=study_name)
    pl.add_argument("--config", metavar="FILE", type=Path, help="study spec (.toml); default: the study's stored one")
    pl.add_argument(
        "--devices", type=device_list, help="GPU indices (0,1) or cpu:N, as for start; default: this host's"
    )
    pl.add_argument(
        "--device-memory", type=float, metavar="GIB", help="plan for devices of this many GiB (not this host's)"
    )
    storage_arg(pl)
    pl.set_defaults(func=cmd_plan)

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

    ls = sub.add_parser("list", help="every study in the storage: trials by state, best value, live workers")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    storage_arg(ls)
    ls.set_defaults(func=cmd_list)

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


DEFAULT_OUTPUT_DIR = Path("hpsearch-runs")


def _version() -> str:
    """The installed distribution's version (pyproject's), read from its metadata: no import of the package."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hpsearch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--devices", type=device_list, help="GPU indices (0,1) or cpu:N; default: every GPU, else one CPU worker"
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_OUTPUT_DIR,
        metavar="DIR",
        help="where trial checkpoints go (DIR/STUDY/trial-N); default ./hpsearch-runs",
    )


def setup_logging(level: int, who: str) -> None:
    """Every hpsearch process logs ``18:35:30 [who] INFO message`` (who: the command or the worker), so a
    shared terminal reads as one log; Optuna's lines too, at warning level unless debugging."""
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
        return ExitCode.USAGE
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return ExitCode.signalled(signal.SIGINT)
    except Exception as exc:
        from hpsearch.search.python_api.errors import one_line  # the rule the Python API's errors follow too

        said = one_line(exc, getattr(args, "storage", None))
        if said is None:
            raise
        print(f"hpsearch {args.command}: error: {said[0]}", file=sys.stderr)
        return said[1]


def run() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    run()
