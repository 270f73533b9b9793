"""Every user-attribute key is named in storage/attrs.py alone, and the trainer writes none."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from hpsearch.storage import attrs
from hpsearch.trainer.stats import Speed

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("search", "trainer", "storage")
SETTERS = {"set_user_attr", "set_trial_user_attr", "set_study_user_attr"}


def _is_user_attrs(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "user_attrs") or (
        isinstance(node, ast.Name) and node.id == "user_attrs"
    )


def _literal(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def literal_keys(root: Path) -> list[str]:
    """``file:line`` of each literal key given to an attribute setter, ``set_attrs({...})``,
    ``user_attrs.get``, ``user_attrs[...]`` or ``user_attrs={...}``, outside storage/attrs.py."""
    found = []
    for path in sorted(p for top in PRODUCT for p in (root / top).rglob("*.py")):
        if path == root / "storage" / "attrs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            keys: list[ast.expr | None] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in SETTERS and node.args:
                    keys += node.args[:2] if node.func.attr == "set_trial_user_attr" else node.args[:1]
                if node.func.attr == "get" and _is_user_attrs(node.func.value) and node.args:
                    keys.append(node.args[0])
                if node.func.attr == "set_attrs" and node.args and isinstance(node.args[0], ast.Dict):
                    keys += node.args[0].keys
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "user_attrs" and isinstance(kw.value, ast.Dict):
                        keys += kw.value.keys
            if isinstance(node, ast.Subscript) and _is_user_attrs(node.value):
                keys.append(node.slice)
            found += [f"{path.relative_to(root)}:{node.lineno}" for k in keys if _literal(k)]
    return found


def test_no_module_but_storage_attrs_spells_an_attribute_key() -> None:
    assert literal_keys(ROOT) == []


def test_the_trainer_writes_no_attribute() -> None:
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((ROOT / "trainer").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and ("user_attr" in node.attr or node.attr == "set_attrs")
    ]
    assert calls == []


def test_the_figure_status_shows_is_a_speed_field() -> None:
    # Figures are stored under their field names: attrs.SPEED must name one, or status shows None.
    assert attrs.SPEED in {f.name for f in fields(Speed)}


def test_retention_ranks_by_the_loss_the_reporter_wrote(tmp_path: Path) -> None:
    """A tie of the objective goes to the lower validation loss: the key retention reads must be the one the
    trainer's best point is written under."""
    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.storage.retention import recorded_loss

    reporter = NullReporter()
    reporter.best_saved(tmp_path, 7, {"accuracy": 0.9, "loss": 0.25})
    assert recorded_loss(reporter.attrs) == 0.25
