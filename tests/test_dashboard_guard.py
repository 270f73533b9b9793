"""Who `hpsearch dashboard` serves: Host check, token, read-only mode, foreign origins.

Real HTTP against a real server (in-process, or the CLI in a subprocess), on a copy of the
finished study of test_dashboard.py, on SQLite and on the real PostgreSQL. Off-loopback
binds use 127.0.0.2 (or 0.0.0.0 reached on 127.0.0.1): only loopback traffic.
"""

from __future__ import annotations

import http.client
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import optuna
import pytest

from hpsearch.search.views import dashboard as dash
from tests.conftest import hpsearch
from tests.test_dashboard import STUDY, finished_study, spawn_dashboard

NEW_STUDY = json.dumps({"study_name": "created-by-a-visitor", "directions": ["minimize"]})


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, demo_files: tuple[Path, Path]) -> str:
    return finished_study(tmp_path_factory, tiny_model, demo_files)


def copy_of(study_url: str, folder: Path) -> str:
    """The finished hpsearch study (its own tables too) in a file of this test."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / "study.db"
    with sqlite3.connect(study_url.removeprefix("sqlite:///")) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    return f"sqlite:///{copy}"


@pytest.fixture(params=["sqlite", "postgresql"])
def study_url(request: pytest.FixtureRequest, tmp_path: Path, finished: str) -> str:
    if request.param == "sqlite":
        return copy_of(finished, tmp_path / "copy")
    pg = str(request.getfixturevalue("pg_url")).replace("postgresql://", "postgresql+psycopg2://", 1)
    optuna.copy_study(from_study_name=STUDY, from_storage=finished, to_storage=pg)
    return pg


def study_names(url: str) -> list[str]:
    return sorted(s.study_name for s in optuna.get_all_study_summaries(url))


@contextmanager
def served(url: str, host: str = "127.0.0.1", **kwargs: Any) -> Iterator[dash.Dashboard]:
    served = dash.create(url, STUDY, host, 0, environ=kwargs.pop("environ", {}), **kwargs)
    thread = threading.Thread(target=served.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.server.shutdown()
        thread.join(timeout=30)


def call(
    served: dash.Dashboard,
    method: str,
    path: str,
    *,
    host: str | None = None,
    body: str | None = None,
    **headers: str,
) -> tuple[int, str, http.client.HTTPResponse]:
    """One real HTTP request; ``host`` is the Host header (default: the address it listens on)."""
    address = str(served.server.server_address[0])
    address = "127.0.0.1" if address == "0.0.0.0" else address
    conn = http.client.HTTPConnection(address, served.port, timeout=60)
    sent = {"Host": host or f"{address}:{served.port}", **{k.replace("_", "-"): v for k, v in headers.items()}}
    if body is not None:
        sent["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        return response.status, response.read().decode(), response
    finally:
        conn.close()


def bearer(served: dash.Dashboard) -> dict[str, str]:
    assert served.policy.token
    return {"Authorization": f"Bearer {served.policy.token}"}


# -- Host header ------------------------------------------------------------------------------


def test_a_foreign_host_is_refused_and_a_post_creates_no_study(study_url: str) -> None:
    before = study_names(study_url)
    with served(study_url) as d:  # loopback: writable, no token
        status, body, _ = call(d, "POST", "/api/studies", host=f"evil.example:{d.port}", body=NEW_STUDY)
        assert status == 403, body
        assert f"Host evil.example:{d.port} is not a name this dashboard answers to" in body
        assert "--allow-host" in body
        assert call(d, "GET", "/api/studies", host="evil.example")[0] == 403
        assert call(d, "GET", "/dashboard", host="127.0.0.1.evil.example")[0] == 403
        # Its own names pass, on any port (an SSH tunnel may use another local port).
        for name in (f"127.0.0.1:{d.port}", f"localhost:{d.port}", f"[::1]:{d.port}", "localhost:9999"):
            status, body, _ = call(d, "GET", "/api/studies", host=name)
            assert status == 200 and STUDY in body, (name, status, body)
    assert study_names(study_url) == before


def test_allow_host_adds_a_name_and_loopback_writes_with_its_own_host_work(tmp_path: Path, finished: str) -> None:
    url = copy_of(finished, tmp_path)
    with served(url, allow_hosts=["Proxy.Example:8443"]) as d:
        assert call(d, "GET", "/api/studies", host="proxy.example")[0] == 200
        assert call(d, "GET", "/api/studies", host="other.example")[0] == 403
        # The page's own write: same Host and Origin.
        origin = f"http://127.0.0.1:{d.port}"
        status, body, _ = call(d, "POST", "/api/studies", body=NEW_STUDY, Origin=origin)
        assert status == 201, body
        # Behind a proxy that rewrote the Host header, the page's Origin names the allowed host.
        renamed = json.dumps({"study_name": "second", "directions": ["maximize"]})
        status, body, _ = call(d, "POST", "/api/studies", body=renamed, Origin="https://proxy.example:8443")
        assert status == 201, body
    assert study_names(url) == sorted([STUDY, "created-by-a-visitor", "second"])


def test_a_write_from_a_page_of_another_origin_is_refused_on_loopback(study_url: str) -> None:
    before = study_names(study_url)
    with served(study_url) as d:
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "http://127.0.0.1:3000"},  # another local service's page: same site, not same origin
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            status, body, _ = call(d, "POST", "/api/studies", body=NEW_STUDY, **headers)
            assert status == 403 and "from a page of another site" in body, (headers, status, body)
        study_id = d.url.rsplit("/", 1)[1]
        status, _, _ = call(d, "DELETE", f"/api/studies/{study_id}", Origin="http://evil.example")
        assert status == 403
        # Reading stays open to the page's own origin.
        assert call(d, "GET", "/api/studies", Origin=f"http://127.0.0.1:{d.port}")[0] == 200
    assert study_names(study_url) == before


# -- token off loopback -----------------------------------------------------------------------


def test_off_loopback_every_request_needs_the_token(tmp_path: Path, finished: str) -> None:
    url = copy_of(finished, tmp_path)
    with served(url, host="127.0.0.2") as d:
        token = d.policy.token
        assert token and len(token) >= 24 and d.open_url.endswith(f"?token={token}")
        for path in ("/api/studies", "/dashboard", "/static/bundle.js", "/csv/1"):
            status, body, response = call(d, "GET", path)
            assert status == 401, (path, status)
            assert "needs its token" in body and response.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert call(d, "GET", "/api/studies", Authorization="Bearer wrong-token-of-the-same-size!")[0] == 401
        assert call(d, "GET", "/api/studies?token=wrong")[0] == 401
        assert call(d, "GET", "/api/studies", Cookie=f"{d.policy.cookie_name}={token}")[0] == 401
        status, body, _ = call(d, "GET", "/api/studies", **bearer(d))
        assert status == 200 and STUDY in body
        # ?token= once: the answer sets a cookie that the page's own API calls then carry.
        status, body, response = call(d, "GET", f"/dashboard/studies/1?token={token}")
        assert status == 200 and "<title>Optuna Dashboard" in body
        cookie = response.getheader("Set-Cookie", "")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token not in cookie
        pair = cookie.split(";", 1)[0]
        status, body, _ = call(d, "GET", "/api/studies", Cookie=pair)
        assert status == 200 and STUDY in body


def test_the_token_can_come_from_the_environment_and_is_not_printed(tmp_path: Path, finished: str) -> None:
    url = copy_of(finished, tmp_path)
    secret = "a-password-of-my-own-choosing"
    with served(url, host="127.0.0.2", environ={"HPSEARCH_DASHBOARD_TOKEN": secret}) as d:
        text = dash.how_to_reach(d, "127.0.0.2", STUDY, url)
        assert d.policy.token == secret and secret not in text and "$HPSEARCH_DASHBOARD_TOKEN" in text
        assert call(d, "GET", "/api/studies", Authorization=f"Bearer {secret}")[0] == 200
        assert call(d, "GET", "/api/studies")[0] == 401
    # Set on loopback, it is required there too.
    with served(url, environ={"HPSEARCH_DASHBOARD_TOKEN": secret}) as d:
        assert call(d, "GET", "/api/studies")[0] == 401
        assert call(d, "GET", "/api/studies", Authorization=f"Bearer {secret}")[0] == 200


# -- read-only and writable -------------------------------------------------------------------


def test_read_only_off_loopback_refuses_every_write(study_url: str) -> None:
    before = study_names(study_url)
    with served(study_url, host="127.0.0.2") as d:
        study_id = d.url.rsplit("/", 1)[1]
        assert d.policy.read_only
        for method, path, body in (
            ("POST", "/api/studies", NEW_STUDY),
            ("DELETE", f"/api/studies/{study_id}", None),
            ("PUT", f"/api/studies/{study_id}/note", json.dumps({"version": 1, "body": "defaced"})),
            ("POST", f"/api/studies/{study_id}/rename", json.dumps({"study_name": "renamed"})),
            ("POST", "/incompatible-rdb-schema", None),
        ):
            status, text, _ = call(d, method, path, body=body, **bearer(d))
            assert status == 403, (method, path, status, text)
            assert "read-only" in text and "--writable" in text, text
        status, text, _ = call(d, "GET", f"/api/studies/{study_id}", **bearer(d))
        assert status == 200 and "defaced" not in text
    assert study_names(study_url) == before


def test_writable_allows_writes_off_loopback_and_read_only_forbids_them_on_it(study_url: str) -> None:
    with served(study_url, host="127.0.0.2", writable=True) as d:
        status, body, _ = call(d, "POST", "/api/studies", body=NEW_STUDY, **bearer(d))
        assert status == 201, body
    assert study_names(study_url) == sorted([STUDY, "created-by-a-visitor"])
    with served(study_url, writable=False) as d:
        other = json.dumps({"study_name": "another", "directions": ["minimize"]})
        assert call(d, "POST", "/api/studies", body=other)[0] == 403
    assert "another" not in study_names(study_url)


# -- the CLI ----------------------------------------------------------------------------------


@contextmanager
def cli_dashboard(*args: str, cwd: Path) -> Iterator[list[str]]:
    """`hpsearch dashboard ... --port 0`, yielding the lines it printed up to Ctrl-C's."""
    proc = spawn_dashboard(*args, cwd=cwd, unset=("HPSEARCH_STORAGE", "HPSEARCH_DASHBOARD_TOKEN"))
    try:
        assert proc.stdout is not None
        printed: list[str] = []
        deadline = time.monotonic() + 120
        while not (printed and printed[-1].startswith("Ctrl-C")) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"dashboard exited: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")
            printed.append(line.rstrip("\n"))
        yield printed
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get(url: str, **headers: str) -> tuple[int, str, http.client.HTTPResponse]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", f"{parts.path}?{parts.query}" if parts.query else parts.path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode(), response
    finally:
        conn.close()


def test_cli_on_every_interface_prints_a_token_url_and_browses_read_only(tmp_path: Path, finished: str) -> None:
    url = copy_of(finished, tmp_path / "copy")
    with cli_dashboard("--study", STUDY, "--storage", url, "--host", "0.0.0.0", cwd=tmp_path) as printed:
        text = "\n".join(printed)
        opened = next(line.split("open ", 1)[1] for line in printed if line.strip().startswith("open http://"))
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/dashboard/studies/\d+\?token=([\w-]+)", opened)
        assert match, opened
        port, token = match.groups()
        assert "can:  browse every study of this storage, nothing else (read-only; --writable" in text
        assert "only a browser or client holding the token" in text
        assert f"ssh -N -L 127.0.0.1:{port}:127.0.0.1:{port} -p SSH_PORT root@SSH_HOST" in text
        assert " -g" not in text and "-CNg" not in text
        assert text.count(token) == 2, "the token is printed with the two URLs, nowhere else"
        assert get(opened.split("?")[0])[0] == 401
        status, body, response = get(opened)
        assert status == 200 and "<title>Optuna Dashboard" in body
        cookie = response.getheader("Set-Cookie", "").split(";", 1)[0]
        assert get(f"http://127.0.0.1:{port}/api/studies", Cookie=cookie)[0] == 200
    # and the CLI's --writable reaches the guard
    with cli_dashboard("--storage", url, "--host", "127.0.0.2", "--writable", cwd=tmp_path) as printed:
        assert any("can:  browse every study of this storage and change them" in line for line in printed)


def test_cli_on_loopback_says_who_and_what_with_a_tunnel_without_g(tmp_path: Path, finished: str) -> None:
    with cli_dashboard("--study", STUDY, "--storage", finished, cwd=tmp_path) as printed:
        text = "\n".join(printed)
        port = re.search(r"open http://127\.0\.0\.1:(\d+)/dashboard/studies/\d+$", text, re.M)
        assert port, text
        p = port.group(1)
        assert f"  SSH tunnel:  ssh -N -L 127.0.0.1:{p}:127.0.0.1:{p} -p SSH_PORT root@SSH_HOST" in text
        # No ssh -g anywhere (it would open the tunnel to the visitor's whole network); the
        # storage's path may hold "-g" (pytest-xdist's popen-gw2), so only words are looked at.
        assert not re.search(r"(^|\s)-g\b", text), text
        assert "who:  anyone on this machine (loopback needs no token)" in text
        assert "can:  browse every study of this storage and change them: edit notes" in text
        assert "token=" not in text


def note_body(url: str) -> str:
    from optuna_dashboard._note import get_note

    return get_note(optuna.load_study(study_name=STUDY, storage=url))


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--host", "203.0.113.9"], {}, "--host 203.0.113.9: not an address of this machine"),
        (["--allow-host", "http://x.example/"], {}, "--allow-host 'http://x.example/': give the host name"),
        (["--host", "0.0.0.0"], {"HPSEARCH_DASHBOARD_TOKEN": "short"}, "HPSEARCH_DASHBOARD_TOKEN is 5 characters"),
    ],
)
def test_refused_arguments_leave_the_study_note_untouched(
    tmp_path: Path,
    finished: str,
    args: list[str],
    env: dict[str, str],
    expected: str,
) -> None:
    url = copy_of(finished, tmp_path / "copy")
    from optuna_dashboard import save_note

    save_note(optuna.load_study(study_name=STUDY, storage=url), "stale")
    result = hpsearch("dashboard", "--study", STUDY, "--storage", url, *args, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert note_body(url) == "stale"


def _raw_get(port: int, path: str, headers: str = "") -> tuple[bytes, bytes]:
    """A GET with only the headers given (http.client adds an Accept-Encoding of its own accord)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}Connection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def test_a_static_file_is_served_to_a_client_that_sends_no_accept_encoding(tmp_path: Path, finished: str) -> None:
    """curl, wget and health checks send no Accept-Encoding: optuna-dashboard read it unguarded and answered 500."""
    with served(copy_of(finished, tmp_path)) as d:
        for path in ("/static/bundle.js", "/favicon.ico"):
            head, body = _raw_get(d.port, path)
            assert head.split(b" ")[1] == b"200", head.decode()[:500]
            assert b"content-encoding: gzip" not in head.lower() and body, path
        # A browser's request still gets the compressed copy.
        head, _ = _raw_get(d.port, "/static/bundle.js", "Accept-Encoding: gzip, deflate\r\n")
        assert head.split(b" ")[1] == b"200" and b"content-encoding: gzip" in head.lower(), head.decode()[:500]
