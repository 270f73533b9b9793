"""Every product module imports alone: no import cycle hides behind an import order that happens to work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"search": "hpsearch.search", "trainer": "hpsearch.trainer", "storage": "hpsearch.storage"}


def product_modules() -> list[str]:
    """Every module of search/, trainer/ and storage/ (presets' too), as installed (pyproject's package-dir)."""
    names = ["hpsearch"]
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[0] == "api":  # the folder installed as `hpsearch` itself
                continue
            names.append(".".join((package, *parts)).removesuffix(".__init__"))
    return names


def test_each_product_module_imports_alone() -> None:
    modules = product_modules()
    assert len(modules) > 90 and "hpsearch.trainer.sharding" in modules and "hpsearch.search.presets" in modules
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "import_each.py"), *modules],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{name}:\n{why}" for name, why in failed.items())
