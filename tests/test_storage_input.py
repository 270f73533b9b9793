"""Bad storage input: one line, exit code 2, no part of a password."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hpsearch.storage import urls
from tests.conftest import hpsearch

COMMANDS = ["start", "worker", "status", "best", "reap", "dashboard"]


def _error_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The refusal: exit 2, no traceback, and the last line is `hpsearch COMMAND: error: ...`
    (a `start` may log a line or two first while it reads the data)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hpsearch {command}: error: "), result.stderr[-3000:]
    assert sum("error" in line for line in result.stderr.splitlines()) == 1, result.stderr[-3000:]
    return last


# -- 1. passwords -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_password_with_an_unescaped_at_is_never_printed(tmp_path: Path, command: str) -> None:
    url = "postgresql://postgres:S3cr@tPW@127.0.0.1:5432/somedb"
    result = hpsearch(command, "--study", "x", "--storage", url, cwd=tmp_path)
    line = _error_line(result, command)
    for piece in ("S3cr", "tPW", "S3cr@tPW"):
        assert piece not in result.stderr + result.stdout, f"{piece!r} of the password was printed: {line}"
    assert "127.0.0.1:5432/somedb" in line, "the host is still named"
    assert "'@'" in line and "%40" in line, f"the fix (write '@' as %40) is not given: {line}"
    assert not (tmp_path / "hpsearch.db").exists()


@pytest.mark.parametrize(
    "url,secret",
    [
        ("postgresql://hp:S3cr@tPW@10.0.0.5:5432/db", ("S3cr", "tPW")),
        # The parser ends the password at the first "@" and reads "cD/eF" as host and path.
        ("postgresql://hp:aB@cD/eF@10.0.0.5/db", ("aB", "cD", "eF")),
        # A "/" in the user name: the parser finds no user and reads it all as host and path.
        ("postgresql://h/p:pw9x@10.0.0.5/db", ("pw9x",)),
        ("postgresql://hp:pQ?x@yZ@10.0.0.5/db", ("pQ", "yZ")),
        # One slash: no parser reads it, and it is echoed in the "not a URL" message.
        ("postgresql:/hp:pw9x@10.0.0.5/db", ("pw9x",)),
    ],
)
def test_mask_and_refusal_show_no_part_of_a_password(url: str, secret: tuple[str, ...]) -> None:
    masked = urls.mask(url)
    assert masked.endswith("@10.0.0.5:5432/db") or masked.endswith("@10.0.0.5/db"), masked
    assert not any(s in masked for s in secret), masked
    with pytest.raises(Exception) as refused:
        urls.normalize(url)
    assert not any(s in str(refused.value) for s in secret), str(refused.value)
    assert "%" in str(refused.value) or "not a URL" in str(refused.value), str(refused.value)


def test_a_percent_encoded_at_still_works() -> None:
    url = "postgresql://hp:S3cr%40tPW@10.0.0.5:5432/db"
    assert urls.parse(url).password == "S3cr@tPW" and urls.parse(url).host == "10.0.0.5"
    assert urls.mask(url) == "postgresql://hp:***@10.0.0.5:5432/db"
    assert urls.mask("sqlite:////data/a@b.db") == "sqlite:////data/a@b.db", "no password in a SQLite path"
