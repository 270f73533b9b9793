"""Who `hpsearch dashboard` serves: a WSGI middleware in front of optuna-dashboard, which lets any request read,
create, rename and delete every study of the storage. Before it sees a request, this checks, in order:

1. the Host header names this server (a loopback name, the bound address, an ``--allow-host`` name): a page of
   another site that rebinds its own name to 127.0.0.1 (DNS rebinding) makes the browser send that name.
2. the token, when one is set (off loopback, or HPSEARCH_DASHBOARD_TOKEN): ``?token=`` once (then a cookie, so the
   page's own API calls carry it), the cookie, or ``Authorization: Bearer``.
3. writes (any method but GET/HEAD/OPTIONS): refused in read-only mode, else when a browser says the request comes
   from another origin (CSRF: the cookie of a loopback dashboard without a token proves nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from hpsearch.search.errors import UsageError

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger(__name__)

TOKEN_ENV = "HPSEARCH_DASHBOARD_TOKEN"
MIN_TOKEN_LENGTH = 16
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def _ip(value: str) -> str | None:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


def host_name(value: str) -> str | None:
    """The name part of a Host header or ``--allow-host`` value, lowercased, IPv6 without brackets."""
    value = value.strip()
    if ip := _ip(value):  # a bare IPv6 address, as --host takes it
        return ip
    if not value or any(c in value for c in "/?#@\\ \t"):
        return None
    try:
        parts = urlsplit(f"//{value}")
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return None
    name = (parts.hostname or "").rstrip(".")
    return _ip(name) or name or None


def proxy_names(values: Iterable[str]) -> frozenset[str]:
    """The ``--allow-host`` values as host names; a URL or a path is refused."""
    names = set()
    for value in values:
        name = host_name(value)
        if name is None:
            raise UsageError(
                f"--allow-host {value!r}: give the host name the browser's address bar shows, without "
                "http:// or a path (e.g. --allow-host u12345-abcd.westb.seetacloud.com)"
            )
        names.add(name)
    return frozenset(names)


def allowed_names(bound: str, resolved: str, proxied: frozenset[str]) -> frozenset[str]:
    """Loopback names, the address the server was bound to (as given and as resolved), ``--allow-host``."""
    given = {host_name(value) for value in (bound, resolved) if value not in WILDCARD_BINDS}
    return LOOPBACK_NAMES | proxied | {name for name in given if name}


def check_token(token: str) -> str:
    """A token from the environment: long enough to guard a port on the internet, and header-safe."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise UsageError(
            f"{TOKEN_ENV} is {len(token)} characters; use at least {MIN_TOKEN_LENGTH} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise UsageError(f"{TOKEN_ENV} must be printable ASCII without spaces (it travels in an HTTP header)")
    return token


@dataclass(frozen=True)
class Policy:
    """What the guard lets through; built once by dashboard.create."""

    names: frozenset[str]
    """Host names (any port) this server answers to."""
    proxied: frozenset[str]
    """The ``--allow-host`` names: a page served under one of them may write even where a proxy
    rewrote the Host header (its Origin then names the public host, the Host header another)."""
    any_ip: bool
    """Bound to every interface: any IP-literal Host is this machine (and cannot be a rebinding)."""
    token: str | None
    read_only: bool
    read_only_reason: str
    """The end of the 403 body for a write: why, and how to enable writes if that is possible."""
    port: int

    @property
    def cookie_name(self) -> str:
        # Cookies ignore ports: two dashboards on one host each need their own.
        return f"hpsearch_dashboard_{self.port}"

    @property
    def cookie_value(self) -> str:
        # A digest, not the token: any token makes a valid cookie value, and the browser never stores the secret.
        assert self.token is not None
        return hmac.new(self.token.encode(), b"hpsearch-dashboard-cookie", hashlib.sha256).hexdigest()

    def host_allowed(self, header: str) -> bool:
        name = host_name(header)
        return name is not None and (name in self.names or (self.any_ip and _ip(name) is not None))


def guard(app: WSGIApplication, policy: Policy) -> WSGIApplication:
    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "")
        if not policy.host_allowed(host):
            shown = _printable(host) or "(none)"
            log.info("refused a request for Host %s (not a name of this dashboard)", shown)
            return _refuse(
                start_response,
                "403 Forbidden",
                f"hpsearch dashboard: Host {shown} is not a name this dashboard answers to (a page of another "
                f"site?); if you reach it by that name, restart it with --allow-host {shown}",
            )
        if policy.token is not None:
            verdict = _authenticate(environ, policy)
            if verdict is None:
                return _refuse(
                    start_response,
                    "401 Unauthorized",
                    "hpsearch dashboard: this dashboard needs its token: open the URL `hpsearch dashboard` "
                    "printed (it ends in ?token=...), or send the header 'Authorization: Bearer TOKEN'",
                    [("WWW-Authenticate", 'Bearer realm="hpsearch dashboard"')],
                )
            if verdict == "query":
                start_response = _setting_cookie(start_response, policy)
        method = environ.get("REQUEST_METHOD", "GET").upper()
        if method not in SAFE_METHODS:
            if policy.read_only:
                return _refuse(
                    start_response, "403 Forbidden", f"hpsearch dashboard is read-only: {policy.read_only_reason}"
                )
            foreign = _foreign_origin(environ, host, policy)
            if foreign is not None:
                log.info("refused a %s from the page of another origin (%s)", method, foreign)
                return _refuse(
                    start_response,
                    "403 Forbidden",
                    f"hpsearch dashboard: a write from a page of another site ({foreign}) is refused",
                )
        # optuna-dashboard's send_static reads the header unguarded (a KeyError, answered 500 with a traceback,
        # for curl, wget and health checks, which send none); no header means any encoding is fine, RFC 9110 12.5.3.
        # "identity": the client gets the file as it is, never a compressed copy it did not ask for.
        environ.setdefault("HTTP_ACCEPT_ENCODING", "identity")
        return app(environ, start_response)

    return guarded


def _authenticate(environ: WSGIEnvironment, policy: Policy) -> str | None:
    """How the request proved the token ("query", "cookie", "bearer"), or None."""
    assert policy.token is not None
    token = policy.token.encode()
    query = parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    offered = [v for k, v in query if k == "token"]
    if offered and hmac.compare_digest(offered[0].encode(), token):
        # optuna-dashboard never sees the secret (nor logs it in an error).
        environ["QUERY_STRING"] = urlencode([(k, v) for k, v in query if k != "token"])
        return "query"
    scheme, _, credentials = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token):
        return "bearer"
    try:
        cookie = SimpleCookie(environ.get("HTTP_COOKIE", "")).get(policy.cookie_name)
    except CookieError:
        cookie = None
    if cookie is not None and hmac.compare_digest(cookie.value.encode(), policy.cookie_value.encode()):
        return "cookie"
    return None


def _setting_cookie(start_response: StartResponse, policy: Policy) -> StartResponse:
    # HttpOnly: the page's scripts never read it; SameSite=Strict: no page of another site makes the browser send it.
    cookie = f"{policy.cookie_name}={policy.cookie_value}; Path=/; HttpOnly; SameSite=Strict"

    def with_cookie(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], object]:
        return start_response(status, [*headers, ("Set-Cookie", cookie)], exc_info)

    return with_cookie


def _foreign_origin(environ: WSGIEnvironment, host: str, policy: Policy) -> str | None:
    """The origin of a browser page on another site that sent this request, else None. Browsers send Origin with
    every POST, PUT and DELETE (and Sec-Fetch-Site), which a page cannot remove; curl or a script sends neither."""
    origin = environ.get("HTTP_ORIGIN")
    if origin is not None:
        if origin.strip().lower() == "null":
            return "null"
        parts = urlsplit(origin.strip())
        name = host_name(parts.netloc) if parts.netloc else None
        same = parts.netloc.lower() == host.strip().lower()
        if not same and name not in policy.proxied:
            return _printable(origin)
    if environ.get("HTTP_SEC_FETCH_SITE", "").lower() == "cross-site":
        return _printable(origin or "cross-site")
    return None


def _printable(value: str) -> str:
    return "".join(c for c in value if c.isprintable() and c.isascii())[:100]


def _refuse(
    start_response: StartResponse, status: str, message: str, extra: list[tuple[str, str]] | None = None
) -> Iterator[bytes]:
    body = (message + "\n").encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            ("X-Content-Type-Options", "nosniff"),
            ("Cache-Control", "no-store"),
            *(extra or []),
        ],
    )
    return iter([body])
