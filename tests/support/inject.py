"""The environment a test gives a process it starts to inject a fault there (tests/support/faults/sitecustomize.py
says which faults exist): the product reads no test variable itself."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS = Path(__file__).parent / "faults"


def faults_env(**faults: str) -> dict[str, str]:
    """``faults`` (e.g. HPSEARCH_FAULT_OOM="1:6:4") with the fault module first on the processes' PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **faults}
