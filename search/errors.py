"""Bad input, said in one line that names the value and the rule: the CLI prints it and exits 2."""

from __future__ import annotations

from hpsearch.trainer.config import ConfigError


class SpecError(ConfigError):
    """The spec is invalid; the message names the field and the rule."""


class UsageError(Exception):
    """Bad input from the user (a flag, a missing spec): printed as one line, exit code 2."""
