"""`hpsearch dashboard`: optuna-dashboard on a study's storage, on localhost unless asked otherwise.

The dashboard reads the same tables the workers write, so a running search shows up live:
intermediate curves, parameters, user attributes (checkpoint, throughput, memory, device,
host, fail reason), parameter importance and the study note (note.py). It can also edit and
delete studies, which is why it binds 127.0.0.1 by default and the printed advice is an SSH
tunnel: AutoDL instances sit on shared public addresses.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna

from hpsearch.search import note, study as studies
from hpsearch.search.spec import SpecError
from hpsearch.storage import urls
from hpsearch.storage.open import Storage, open_storage, require_study

log = logging.getLogger(__name__)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
AUTODL_PORT = 6006
"""The instance port AutoDL's console maps to a public link ("自定义服务")."""


class DashboardError(ValueError):
    """The dashboard cannot be served as asked (port taken, unknown host): one line, exit 2."""


class _Server(ThreadingMixIn, WSGIServer):
    # The page fires several API calls at once; one thread each, as optuna-dashboard's own CLI.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


@dataclass
class Dashboard:
    server: WSGIServer
    url: str
    """The page to open: the study's page when a study was named, else the study list."""
    storage: optuna.storages.RDBStorage
    read_only: bool = False
    """The storage is a SQLite file this user cannot write: the page browses, edits fail."""

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self.server.server_close()
            self.storage.engine.dispose()


def create(storage_url: str, study: str | None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> Dashboard:
    """Check the storage and study, refresh the study note, bind the server (not serving yet)."""
    if not 0 <= port <= 65535:
        raise DashboardError(f"--port {port}: must be between 1 and 65535 (0 picks a free port)")
    # A SQLite file this user cannot write (a copy on a read-only mount) is browsed read-only.
    checked = open_storage(storage_url, create=False, read_only=True)
    try:
        study_id = require_study(checked, study) if study else None
        if study and not checked.read_only:
            try:
                _refresh_note(checked, study)
            except Exception as exc:
                # The note is a convenience; a read-only database user must still see the study.
                log.warning("could not update the study note: %s", str(exc).splitlines()[0])
    finally:
        checked.close()
    # A few pooled connections for the threaded server; skip table creation: a viewer
    # must not change the schema of a database that workers are writing to.
    rdb = optuna.storages.RDBStorage(
        checked.url, engine_kwargs=checked.engine_kwargs(pool_size=4), skip_table_creation=True
    )
    from optuna_dashboard import wsgi

    try:
        server = make_server(host, port, wsgi(rdb), server_class=_Server, handler_class=_QuietHandler)
    except OSError as exc:
        rdb.engine.dispose()
        raise DashboardError(_bind_error(host, port, exc)) from None
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "localhost") else host
    if ":" in shown:
        shown = f"[{shown}]"
    path = f"/dashboard/studies/{study_id}" if study_id is not None else "/dashboard"
    url = f"http://{shown}:{server.server_port}{path}"
    return Dashboard(server=server, url=url, storage=rdb, read_only=checked.read_only)


def _refresh_note(storage: Storage, name: str) -> None:
    """Bring the note up to date (a study finished before notes existed, or by a crashed run)."""
    try:
        spec = studies.stored_spec(storage, name)
    except SpecError:
        return  # not an hpsearch study: nothing to summarise, show it as it is
    study = optuna.load_study(study_name=name, storage=storage.optuna)
    note.update(study, spec, studies.n_trials(study, spec))


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another dashboard or TensorBoard?); "
            f"pass another --port, e.g. --port {port + 1}"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"port {port} needs root here; pass a port above 1023, e.g. --port {DEFAULT_PORT}"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; use 127.0.0.1 (SSH tunnel) or 0.0.0.0 (every interface)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


def how_to_reach(dash: Dashboard, host: str, study: str | None, storage_display: str) -> str:
    """What to print: the URL, and how to open it from a laptop when the search runs on AutoDL."""
    port, path = dash.port, dash.url.split(f":{dash.port}", 1)[1]
    what = f"study {study!r}" if study else "all studies"
    lines = [
        f"optuna-dashboard: {what} in {storage_display}",
        f"  open {dash.url}",
        "",
        "From your own computer (the search runs on a remote instance, e.g. AutoDL):",
        f"  SSH tunnel:  ssh -CNg -L {port}:127.0.0.1:{port} -p SSH_PORT root@SSH_HOST",
        "               (SSH_HOST and SSH_PORT: from the instance's login command `ssh -p SSH_PORT root@SSH_HOST`),",
        f"               then open http://127.0.0.1:{port}{path}",
    ]
    if dash.read_only:
        lines.insert(1, "  read-only (this user cannot write the file): browsing works, notes and deletions do not")
    if port == AUTODL_PORT and host not in ("127.0.0.1", "localhost", "::1"):
        lines.append(f"  AutoDL custom service (自定义服务): open the console's link for port {port}, then {path}")
    else:
        lines.append(
            "  AutoDL custom service (自定义服务): restart with "
            f"--host 0.0.0.0 --port {AUTODL_PORT} and open the console's link"
        )
    if host not in ("127.0.0.1", "localhost", "::1"):
        lines.append(
            f"  warning: listening on {host}: anyone who reaches this port can edit and delete "
            "studies; prefer the SSH tunnel"
        )
    lines.append("Ctrl-C stops the dashboard (the search is not affected).")
    return "\n".join(lines)


def run(storage_url: str, study: str | None, host: str, port: int, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    dash = create(storage_url, study, host, port)
    print(how_to_reach(dash, host, study, urls.mask(storage_url)), file=out, flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a dashboard ends
        dash.serve_forever()
    return 0
