"""Import each module named on the command line alone, in a child forked from this process, which has imported the
third-party libraries (so each child is fast) and no module of ours (so each child's import starts from nothing of
hpsearch, as `python -c "import hpsearch.x"` would). Prints, as JSON, the modules that failed and why."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

# Heavy libraries once, here: the children share them (scipy's qmc alone takes seconds). None imports hpsearch.
import optuna  # noqa: F401
import psycopg2  # noqa: F401
import scipy.stats  # noqa: F401
import sqlalchemy.dialects.postgresql
import sqlalchemy.dialects.sqlite
import sqlalchemy.orm  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

assert not [m for m in sys.modules if m == "hpsearch" or m.startswith("hpsearch.")], "the parent imported hpsearch"
failed: dict[str, str] = {}
for name in sys.argv[1:]:
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            os.write(writer, traceback.format_exc(limit=-3).encode())
            code = 1
        os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as said:
        why = said.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed[name] = why or f"exit status {status}"
print(json.dumps(failed))
