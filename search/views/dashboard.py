"""`hpsearch dashboard`: optuna-dashboard on a study's storage (docs/watching.md, "In the browser"). Anyone who
reaches optuna-dashboard may change every study, so dashboard_guard.py stands in front of it; it binds 127.0.0.1
by default (the printed advice is an SSH tunnel: AutoDL instances sit on shared public addresses)."""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import optuna

from hpsearch.search.errors import SpecError, UsageError
from hpsearch.search.study import budget, studies
from hpsearch.search.views import dashboard_guard as guard, note
from hpsearch.storage import ledger
from hpsearch.storage.open import Storage, open_storage, require_study

log = logging.getLogger(__name__)
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
AUTODL_PORT = 6006
"""The instance port AutoDL's console maps to a public link ("自定义服务")."""


class _Server(ThreadingMixIn, WSGIServer):
    # The page fires several API calls at once; one thread each, as optuna-dashboard's own CLI.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # The request line may carry ?token=: never into a log.
        line = re.sub(r"token=[^&\s]*", "token=***", format % args)
        log.debug("%s %s", self.address_string(), line)


@dataclass
class Dashboard:
    server: WSGIServer
    url: str
    """The page to open: the study's page when a study was named, else the study list."""
    storage: optuna.storages.RDBStorage
    policy: guard.Policy
    storage_read_only: bool = False
    """The storage is a SQLite file this user cannot write: the page browses, edits fail."""
    token_from_env: bool = False
    """The token is the user's own (HPSEARCH_DASHBOARD_TOKEN): not printed."""

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def open_url(self) -> str:
        """The URL to print: with the generated token, which the browser then keeps as a cookie."""
        if self.policy.token is None:
            return self.url
        return f"{self.url}?token={'$' + guard.TOKEN_ENV if self.token_from_env else self.policy.token}"

    def serve_forever(self) -> None:
        try:
            self.server.serve_forever()
        finally:
            self.server.server_close()
            self.storage.engine.dispose()


def create(
    storage_url: str,
    study: str | None,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    allow_hosts: Sequence[str] = (),
    writable: bool | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Dashboard:
    """Check the arguments, storage and study, bind, then refresh the study note: a bad --host leaves the study
    as it was. ``writable`` None: writable on loopback, read-only elsewhere."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: must be between 1 and 65535 (0 picks a free port)")
    proxied = guard.proxy_names(allow_hosts)
    user_token = environ.get(guard.TOKEN_ENV) or None
    token = guard.check_token(user_token) if user_token else None
    # No token only where just this machine reaches the server: 127.0.0.2 (the tests' token case) is not such a place.
    private = host in guard.LOOPBACK_NAMES
    if token is None and not private:
        token = secrets.token_urlsafe(24)
    # A SQLite file this user cannot write (a copy on a read-only mount) is browsed read-only.
    checked = open_storage(storage_url, create=False, read_only=True)
    server: _Server | None = None
    try:
        study_id = require_study(checked, study) if study else None
        try:
            server = _Server((host, port), _QuietHandler)
        except OSError as exc:
            raise UsageError(_bind_error(host, port, exc)) from None
        if study and not checked.read_only:
            try:
                _refresh_note(checked, study)
            except Exception as exc:
                # The note is a convenience; a read-only database user must still see the study.
                log.warning("could not update the study note: %s", str(exc).splitlines()[0])
        # A few pooled connections for the threaded server; a viewer never changes the schema workers write to.
        rdb = optuna.storages.RDBStorage(
            checked.url, engine_kwargs=checked.engine_kwargs(pool_size=4), skip_table_creation=True
        )
    except BaseException:
        if server is not None:
            server.server_close()
        raise
    finally:
        checked.close()
    from optuna_dashboard import wsgi

    policy = guard.Policy(
        names=guard.allowed_names(host, str(server.server_address[0]), proxied),
        proxied=proxied,
        any_ip=host in guard.WILDCARD_BINDS,
        token=token,
        read_only=checked.read_only or (not private if writable is None else not writable),
        read_only_reason=(
            "this user cannot write the storage file, so nothing can be changed from here"
            if checked.read_only
            else "visitors can browse, not change studies; restart `hpsearch dashboard` with --writable "
            "to allow edits (notes, deleting studies and trials)"
        ),
        port=int(server.server_port),
    )
    server.set_app(guard.guard(wsgi(rdb), policy))
    path = f"/dashboard/studies/{study_id}" if study_id is not None else "/dashboard"
    url = f"http://{_url_host(host)}:{server.server_port}{path}"
    return Dashboard(server, url, rdb, policy, checked.read_only, token_from_env=user_token is not None)


def _url_host(host: str) -> str:
    """The address that reaches a server bound to ``host``, as a URL writes it (any of its addresses for 0.0.0.0)."""
    shown = "127.0.0.1" if host in (*guard.WILDCARD_BINDS, "localhost") else host
    return f"[{shown}]" if ":" in shown else shown


def _refresh_note(storage: Storage, name: str) -> None:
    """Bring the note up to date (a study finished before notes existed, or by a crashed run)."""
    try:
        spec = studies.stored_spec(storage, name)
    except SpecError:
        return  # not an hpsearch study: nothing to summarise, show it as it is
    study = optuna.load_study(study_name=name, storage=storage.optuna)
    note.update(study, spec, budget.n_trials(study, spec), ledger.device_time(storage.db, name))


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
    """What to print: the URL, who may visit and what they can do, and how to open it from a laptop."""
    port, path = dash.port, dash.url.split(f":{dash.port}", 1)[1]
    query = dash.open_url[len(dash.url) :]
    what = f"study {study!r}" if study else "all studies"
    lines = [
        f"optuna-dashboard: {what} in {storage_display}",
        f"  open {dash.open_url}",
        f"  who:  {_who(dash)}",
        f"  can:  {_can(dash)}",
        "",
        "From your own computer (the search runs on a remote instance, e.g. AutoDL):",
        f"  SSH tunnel:  ssh -N -L 127.0.0.1:{port}:{_url_host(host)}:{port} -p SSH_PORT root@SSH_HOST",
        "               (SSH_HOST and SSH_PORT: from the instance's login command `ssh -p SSH_PORT root@SSH_HOST`),",
        f"               then open http://127.0.0.1:{port}{path}{query}",
    ]
    if dash.storage_read_only:
        lines.insert(1, "  read-only (this user cannot write the file): browsing works, notes and deletions do not")
    if port == AUTODL_PORT and host not in guard.LOOPBACK_NAMES:
        lines.append(
            f"  AutoDL custom service (自定义服务): open the console's link for port {port}, then {path}{query} "
            "(if it answers that its Host is refused, restart with the --allow-host it names)"
        )
    else:
        lines.append(
            "  AutoDL custom service (自定义服务): restart with "
            f"--host 0.0.0.0 --port {AUTODL_PORT} and open the console's link"
        )
    lines.append("Ctrl-C stops the dashboard (the search is not affected).")
    return "\n".join(lines)


def _who(dash: Dashboard) -> str:
    if dash.policy.token is None:
        return "anyone on this machine (loopback needs no token); pages of other sites are refused"
    held = f"${guard.TOKEN_ENV}" if dash.token_from_env else "the token in the URL above"
    return f"only a browser or client holding {held} (sent once as ?token=, then kept as a cookie)"


def _can(dash: Dashboard) -> str:
    if dash.storage_read_only:
        return "browse every study of this storage, nothing else (this user cannot write it)"
    if dash.policy.read_only:
        return "browse every study of this storage, nothing else (read-only; --writable allows edits)"
    return (
        "browse every study of this storage and change them: edit notes, create, rename and delete "
        "studies, finish and annotate trials (--read-only: browse only)"
    )
