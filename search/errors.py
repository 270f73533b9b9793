"""Bad input, said in one line that names the value and the rule: the CLI prints it and exits 2."""

from __future__ import annotations

from hpsearch.search.workers.devices import DeviceError
from hpsearch.storage.errors import StorageUrlError, StudyFolderError, StudyNotFoundError
from hpsearch.trainer.config import ConfigError
from hpsearch.trainer.errors import ModelError
from hpsearch.trainer.reading import DataError


class SpecError(ConfigError):
    """The spec is invalid; the message names the field and the rule."""


class UsageError(Exception):
    """Bad input from the user (a flag, a missing spec): printed as one line, exit code 2."""


USER_ERRORS = (
    UsageError,
    ConfigError,  # SpecError among them
    DataError,
    ModelError,
    DeviceError,
    StorageUrlError,
    StudyNotFoundError,
    StudyFolderError,
)
"""Every error that means bad input, not a failure: one line, exit 2, nothing written."""
