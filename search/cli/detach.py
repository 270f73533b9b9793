"""A search that outlives the process that started it (a notebook's kernel, an SSH session): the real
`hpsearch start` runs under a small keeper in a session of its own, so closing the tab, restarting the kernel or
losing the terminal signals neither. Nothing of the caller is pickled: the keeper and the CLI get only
command-line words and the environment.

The caller waits only for the CLI's checks: a bad spec is the CLI's one line, raised in the caller (`launch`);
once the study is created and its folder claimed (`checks_passed`, called by `start`), the caller returns and the
keeper goes on copying the CLI's output into ``STUDY_DIR/search.log``."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

LOG_NAME = "search.log"
"""The detached search's output (the CLI's log, its summary), in the study's folder."""
READY_ENV = "HPSEARCH_READY_FILE"
"""Set by the keeper for the CLI it runs: the file `checks_passed` creates once everything is checked."""
TAIL_LINES = 40
"""How much of a CLI that ended before its checks passed the caller is shown."""


@dataclass(frozen=True)
class Launched:
    """What `launch` reports: the CLI's pid and log once its checks passed, or how it ended before."""

    pid: int | None
    log: Path | None
    exit_code: int | None
    output: list[str]


def checks_passed() -> None:
    """Called by `hpsearch start` once its checks passed and the study exists: tells a keeper waiting for it (and
    nobody otherwise). The variable is dropped so that the workers it spawns do not inherit it."""
    ready = os.environ.pop(READY_ENV, None)
    if ready:
        Path(ready).touch()


def launch(cli_args: Sequence[str], study_dir: Path, env: dict[str, str]) -> Launched:
    """Start `hpsearch *cli_args` detached and wait until its checks passed (or it ended). ``env`` is the whole
    environment of the CLI (the storage URL goes there, not on a command line that `ps` shows)."""
    command = [sys.executable, "-m", "hpsearch.search.cli.detach", str(study_dir), *cli_args]
    keeper = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the keeper reports on stdout, once; everything else goes to the log
        env=env,
        start_new_session=True,  # no signal for the caller's session or process group reaches it
        text=True,
    )
    assert keeper.stdout is not None
    try:
        said = keeper.stdout.readline()
    except KeyboardInterrupt:
        # Interrupted during the checks: nothing has run yet, so nothing is left running.
        os.killpg(keeper.pid, 15)
        raise
    keeper.stdout.close()
    if not said:  # the keeper itself failed (a bug): say so rather than hang
        code = keeper.wait()
        return Launched(None, None, code or 1, [f"the search's keeper process ended with exit code {code}"])
    report = json.loads(said)
    if report.get("exit_code") is not None:
        keeper.wait()  # it ended with the CLI: reap it
    else:
        # The keeper is this process's child: reaped when it ends (a notebook's kernel lives on), not left a zombie.
        threading.Thread(target=keeper.wait, name="hpsearch-keeper-reaper", daemon=True).start()
    return Launched(
        report.get("pid"),
        Path(report["log"]) if report.get("log") else None,
        report.get("exit_code"),
        report.get("output", []),
    )


def _keep(study_dir: Path, cli_args: list[str], report: IO[str]) -> int:
    """The keeper: run the CLI, hold its output until its checks passed, then report and write the output to the
    study's log until the CLI (and every worker, which shares the pipe) ended."""
    ready = Path(tempfile.mkdtemp(prefix="hpsearch-ready-")) / "ready"
    cli = subprocess.Popen(
        [sys.executable, "-m", "hpsearch.search.cli.main", *cli_args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, READY_ENV: str(ready)},
        text=True,
        errors="replace",
    )
    assert cli.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(cli.stdout, lines), daemon=True).start()
    held: list[str] = []
    out: IO[str] | None = None
    while True:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if out is None:
            if line:
                held.append(line)
            if ready.exists():
                out = _open_log(study_dir, held)
                _say(report, {"pid": cli.pid, "log": str(study_dir / LOG_NAME)})
        elif line:
            out.write(line)
            out.flush()
    code = cli.wait()
    ready.unlink(missing_ok=True)
    ready.parent.rmdir()
    if out is None:  # ended before its checks passed (bad input, or nothing to run): the caller gets it all
        _say(report, {"exit_code": code, "output": [line.rstrip("\n") for line in held[-TAIL_LINES:]]})
        return code
    out.write(f"{time.strftime('%H:%M:%S')} [detach] hpsearch {cli_args[0]} ended with exit code {code}\n")
    out.close()
    return code


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _open_log(study_dir: Path, held: list[str]) -> IO[str]:
    out = (study_dir / LOG_NAME).open("a", encoding="utf-8")
    out.writelines(held)
    out.flush()
    return out


def _say(report: IO[str], message: dict[str, object]) -> None:
    """The keeper's one message to `launch`; its end of the pipe is closed then (the caller may exit)."""
    try:
        report.write(json.dumps(message) + "\n")
        report.flush()
        report.close()
    except (OSError, ValueError):
        pass  # the caller is gone (interrupted): the search goes on regardless


def main(argv: list[str]) -> int:
    study_dir, cli_args = Path(argv[0]), argv[1:]
    return _keep(study_dir, cli_args, sys.stdout)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
