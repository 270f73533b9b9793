"""hpsearch from Python: ``import hpsearch``. Installed as the top-level package ``hpsearch`` (pyproject's
package-dir); the code is in search/api_*.py, this only names what is public. docs/python.md shows it at work.

The names are imported on first use: every `hpsearch` command imports this package first, and `hpsearch --help`
must not wait for optuna and torch (nor may `python -m hpsearch.search.cli` find its module imported already)."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpsearch.search.api_errors import HpsearchError, InputError, SearchError
    from hpsearch.search.api_search import Best, Search, Status
    from hpsearch.search.api_start import load, plan, start, studies
    from hpsearch.search.cli_list import StudyRow

try:
    __version__ = version("hpsearch")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

_HOMES = {
    "HpsearchError": "api_errors",
    "InputError": "api_errors",
    "SearchError": "api_errors",
    "Best": "api_search",
    "Search": "api_search",
    "Status": "api_search",
    "load": "api_start",
    "plan": "api_start",
    "start": "api_start",
    "studies": "api_start",
    "StudyRow": "cli_list",
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
