"""The command line and its documentation agree: every option of every command is in docs/cli.md, in its command's
section, and no help text teaches a password in a URL."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpsearch.search.cli.main import build_parser

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _section(command: str) -> str:
    text = CLI_DOC.read_text()
    start = text.index(f"## `hpsearch {command}`")
    end = text.find("\n## ", start + 1)
    shared = text[text.index("## Options of several commands") :]
    shared = shared[: shared.find("\n## ", 1)]
    return text[start:end] + shared


@pytest.mark.parametrize("command", list(_commands()))
def test_every_option_of_every_command_is_in_docs_cli_md(command: str) -> None:
    section = _section(command)
    options = [o for a in _commands()[command]._actions for o in a.option_strings if o.startswith("--")]
    missing = [o for o in options if o != "--help" and not re.search(rf"`{re.escape(o)}[` \[]", section)]
    assert not missing, f"docs/cli.md, section hpsearch {command}, does not name {missing}"


def test_the_global_options_are_in_docs_cli_md() -> None:
    text = CLI_DOC.read_text()
    options = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert options and all(f"`{o}`" in text for o in options), options


@pytest.mark.parametrize("command", ["start", "worker", "status", "best", "reap", "dashboard"])
def test_no_help_shows_a_password_in_a_url(command: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "hpsearch.search.cli.main", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--storage" in shown
    assert not re.search(r"://[^/@\s]+:[^/@\s]+@", " ".join(shown.split())), shown
