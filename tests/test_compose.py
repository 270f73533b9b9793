"""docker-compose.yml: no Docker engine runs here, so check what compose would run.

The file must parse, the database must keep its data and report health, the password must
come from the environment, and the worker's command must be a real `hpsearch worker` call.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpsearch.search.cli import main as cli
from hpsearch.storage import urls

COMPOSE = Path(__file__).resolve().parent.parent / "docker-compose.yml"
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} rules."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_postgres_keeps_data_reports_health_and_takes_password_from_env(
    compose: dict[str, Any],
) -> None:
    pg = compose["services"]["postgres"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])
    assert pg["volumes"][0].split(":")[0] in compose["volumes"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    password = pg["environment"]["POSTGRES_PASSWORD"]
    assert password.startswith("${HPSEARCH_DB_PASSWORD:?"), "no password literal in the file"
    with pytest.raises(KeyError, match="HPSEARCH_DB_PASSWORD"):
        interpolate(pg["environment"], {})
    # Published on the loopback interface only: exposing it is a deliberate, documented step.
    assert all(p.startswith("127.0.0.1:") for p in pg["ports"])


def test_worker_reserves_gpus_and_waits_for_a_healthy_database(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert worker["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_worker_command_is_a_real_hpsearch_worker_call(compose: dict[str, Any]) -> None:
    env = {"HPSEARCH_DB_PASSWORD": "s3cret", "HPSEARCH_HOST": "instance-b"}
    command = interpolate(compose["services"]["worker"]["command"], env)
    assert command[:2] == ["hpsearch", "worker"]
    args = cli.build_parser().parse_args(command[1:])
    assert args.func is cli.cmd_worker
    assert args.study == "bert-lr" and str(args.output_dir) == "/runs"
    url = urls.parse(args.storage)
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg2",
        "hp",
        None,  # never in argv, where `ps` shows it to every user of the host
        "postgres",
        5432,
        "hpsearch",
    )
    assert interpolate(compose["services"]["worker"]["environment"], env)["PGPASSWORD"] == "s3cret"
    assert "s3cret" not in " ".join(command)
    # On another instance the same service joins the database over a tunnel.
    remote = interpolate(
        compose["services"]["worker"]["command"],
        {**env, "HPSEARCH_DB_HOST": "host.docker.internal", "HPSEARCH_DB_PORT": "15432"},
    )
    url = urls.parse(cli.build_parser().parse_args(remote[1:]).storage)
    assert (url.host, url.port) == ("host.docker.internal", 15432)
    assert interpolate(compose["services"]["worker"]["environment"], env)["HPSEARCH_HOST"] == "instance-b"


def test_remote_worker_reaches_a_tunnel_on_the_hosts_loopback(compose: dict[str, Any]) -> None:
    """On instance B the SSH tunnel to A's database listens on B's 127.0.0.1, which a container
    on a bridge network cannot reach: the remote worker shares the host's network instead."""
    remote = compose["services"]["remote-worker"]
    assert remote["network_mode"] == "host" and remote["profiles"] == ["remote"]
    assert not remote["depends_on"], "no local database to wait for"
    assert remote["deploy"] == compose["services"]["worker"]["deploy"]
    env = {"HPSEARCH_DB_PASSWORD": "s3cret", "HPSEARCH_DB_HOST": "127.0.0.1", "HPSEARCH_DB_PORT": "15432"}
    args = cli.build_parser().parse_args(interpolate(remote["command"], env)[1:])
    url = urls.parse(args.storage)
    assert (url.host, url.port, args.func) == ("127.0.0.1", 15432, cli.cmd_worker)
