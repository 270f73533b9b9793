"""hpsearch from Python: ``import hpsearch``. Installed as the top-level package ``hpsearch`` (pyproject's
package-dir); the code is in search/api_*.py, this only names what is public. docs/python.md shows it at work."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from hpsearch.search.api_errors import HpsearchError, InputError, SearchError
from hpsearch.search.api_search import Best, Search, Status, load, plan, start, studies
from hpsearch.search.cli_list import StudyRow

try:
    __version__ = version("hpsearch")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

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
