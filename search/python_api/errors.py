"""The errors of hpsearch's Python API, and the one rule (shared with the CLI) that says which exceptions are the
user's to fix, in one line, and which are bugs that keep their traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hpsearch.search.exit_codes import ExitCode


class HpsearchError(Exception):
    """Every error ``import hpsearch`` raises on purpose. ``str(error)`` is the line the CLI prints after
    ``hpsearch COMMAND: error:``; ``exit_code`` is the code the CLI exits with (2: bad input, 1: anything else)."""

    def __init__(self, message: str, exit_code: int = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class InputError(HpsearchError):
    """Bad input (a spec, a storage URL, a study name, a device list): nothing was written. The CLI exits 2."""


class SearchError(HpsearchError):
    """Not the input's fault: the storage went away, every trial failed, no worker runs the search."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILED) -> None:
        super().__init__(message, exit_code)


def one_line(exc: BaseException, storage: str | None) -> tuple[str, int] | None:
    """The line and exit code that the CLI (and the API) give ``exc``; None for an error that is a bug and keeps
    its traceback. ``storage``: the --storage argument, named in a damaged SQLite file's message."""
    from hpsearch.search.errors import USER_ERRORS
    from hpsearch.storage import open as storages, urls
    from hpsearch.storage.errors import StorageError

    if isinstance(exc, HpsearchError):
        return str(exc), exc.exit_code
    # A user error first: its line names the file it is about (a warm start's storage that is not a database says
    # so, and must not be taken for this command's --storage).
    if isinstance(exc, USER_ERRORS):
        return str(exc), ExitCode.USAGE
    if said := storages.damaged(exc):  # a page SQLite reads only now, in the middle of a command: the --storage file
        return storages.damaged_message(urls.mask(urls.resolve(storage)), said), ExitCode.USAGE
    if isinstance(exc, StorageError):
        # Not the input's fault (the server went away, a disk filled): an exit code that does not blame the input.
        return str(exc), ExitCode.FAILED
    return None


@contextmanager
def raised_as_hpsearch_errors(storage: str | None) -> Iterator[None]:
    """Turn what the CLI would print as one line into an ``HpsearchError`` with that line (from the original, for
    a debugger); let a bug through untouched."""
    try:
        yield
    except HpsearchError:
        raise
    except Exception as exc:
        said = one_line(exc, storage)
        if said is None:
            raise
        text, code = said
        error = InputError(text) if code == ExitCode.USAGE else SearchError(text, code)
        raise error from exc
