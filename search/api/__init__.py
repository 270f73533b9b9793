"""hpsearch from Python: ``import hpsearch``. Installed as the top-level package ``hpsearch`` (pyproject's
package-dir); the code is in search/python_api/, this only names what is public. docs/python.md shows it at work.

The names are imported on first use: every `hpsearch` command imports this package first, and `hpsearch --help`
must not wait for optuna and torch (nor may `python -m hpsearch.search.cli.main` find its module imported already)."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpsearch.search.cli.list_command import StudyRow
    from hpsearch.search.python_api.errors import HpsearchError, InputError, SearchError
    from hpsearch.search.python_api.search import Best, Search, Status
    from hpsearch.search.python_api.start import load, plan, start, studies

try:
    __version__ = version("hpsearch")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

_HOMES = {
    "HpsearchError": "python_api.errors",
    "InputError": "python_api.errors",
    "SearchError": "python_api.errors",
    "Best": "python_api.search",
    "Search": "python_api.search",
    "Status": "python_api.search",
    "load": "python_api.start",
    "plan": "python_api.start",
    "start": "python_api.start",
    "studies": "python_api.start",
    "StudyRow": "cli.list_command",
}
"""Each public name and its module under hpsearch.search."""

__all__ = [
    "Best",
    "HpsearchError",
    "InputError",
    "Search",
    "SearchError",
    "Status",
    "StudyRow",
    "__version__",
    "load",
    "plan",
    "start",
    "studies",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hpsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpsearch.search.{home}"), name)
    globals()[name] = value  # once: later uses find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
