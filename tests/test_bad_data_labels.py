"""Bad labels and oversized CSV fields: exit code 2, one line naming the file and the fix, nothing written.

The helpers mirror tests/test_bad_input.py (the CLI's main() in-process, refused before storage exists).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpsearch.trainer import reading as data_module
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.splits import read_splits
from tests.conftest import assert_refused, spec_text


def _assert_refused(cli, tmp_path: Path, model: Path, train: Path, dev: Path, expected: str) -> str:  # type: ignore[no-untyped-def]
    """`start` with these data files: exit 2, one line naming the problem, no storage created."""
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(model, train, dev))
    return assert_refused(cli, spec, tmp_path, expected)


def _jsonl(path: Path, labels: list[Any]) -> Path:
    path.write_text("".join(json.dumps({"text": f"example {i}", "label": v}) + "\n" for i, v in enumerate(labels)))
    return path


def _csv(path: Path, labels: list[str], *, text: str = "some words") -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows([text, label] for label in labels)
    return path


# (name, training labels, expected words in the message)
TRAIN_LABEL_CASES: list[tuple[str, list[Any], str]] = [
    (
        "stray_large_int",
        [0, 1, 0, 1000000],
        "train.jsonl: integer labels are class ids and must be consecutive (0..K-1 or 1..K); got 0, 1, 1000000, "
        "with no example of 999998 values between 0 and 1000000; renumber them 0..2 or use string labels",
    ),
    ("gap", [0, 2, 0, 2], "got 0, 2, with no example of 1 between 0 and 2; renumber them 0..1"),
    ("sign_only", [-1, 1, 1], "got -1, 1, with no example of 0 between -1 and 1; renumber them 0..1"),
    ("gaps_listed", [1, 3, 5], "got 1, 3, 5, with no example of 2, 4 between 1 and 5; renumber them 0..2"),
    (
        "huge_float",
        [0, 1, 1e300],
        "train.jsonl: line 3: label 1e+300 in column 'label' is a float; labels must be integers or strings",
    ),
    (
        "integral_float",
        [0, 1.0],
        "line 2: label 1.0 in column 'label' is a float; labels must be integers or strings (write 1, not 1.0)",
    ),
    ("list", [0, [1]], "line 2: label [1] in column 'label' is a list; labels must be integers or strings"),
    ("bool", [0, True], "line 2: label true in column 'label' is a boolean; labels must be integers"),
    ("object", [0, {"id": 1}], "line 2: label {\"id\": 1} in column 'label' is an object; labels must be"),
    ("null", [0, None], "line 2: label null in column 'label' is null; labels must be integers or strings"),
    ("one_string_class", ["positive"] * 4, "has label 'positive'; a classifier needs at least 2 classes"),
    ("one_int_class", [1, 1, 1], "has label 1; a classifier needs at least 2 classes"),
]


@pytest.mark.parametrize("name,labels,expected", TRAIN_LABEL_CASES, ids=[c[0] for c in TRAIN_LABEL_CASES])
def test_bad_training_labels(
    cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], name: str, labels: list[Any], expected: str
) -> None:  # type: ignore[no-untyped-def]
    train = _jsonl(tmp_path / "train.jsonl", labels)
    _assert_refused(cli, tmp_path, tiny_model, train, demo_files[1], expected)


def test_one_class_message_names_the_spec_key(cli, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    train = _jsonl(tmp_path / "train.jsonl", ["pos", "pos"])
    dev = _jsonl(tmp_path / "dev.jsonl", ["pos"])
    line = _assert_refused(cli, tmp_path, tiny_model, train, dev, "a classifier needs at least 2 classes")
    assert line.startswith(f"hpsearch start: error: data.train: every row of {train} has label 'pos'"), line


def test_csv_integer_labels_out_of_range(cli, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    """CSV cells are text: "0", "1", "1000000" are integer labels and get the same rule."""
    train = _csv(tmp_path / "train.csv", ["0", "1", "1000000"])
    dev = _csv(tmp_path / "dev.csv", ["0", "1"])
    _assert_refused(cli, tmp_path, tiny_model, train, dev, "got 0, 1, 1000000, with no example of 999998 values")


def test_csv_one_class(cli, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    train = _csv(tmp_path / "train.csv", ["1", "1"])
    dev = _csv(tmp_path / "dev.csv", ["1"])
    _assert_refused(cli, tmp_path, tiny_model, train, dev, "has label '1'; a classifier needs at least 2 classes")


def test_validation_label_of_wrong_type(cli, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    train = _jsonl(tmp_path / "train.jsonl", [0, 1, 0, 1])
    dev = _jsonl(tmp_path / "dev.jsonl", [0, 0.5])
    _assert_refused(
        cli, tmp_path, tiny_model, train, dev, f"data file {dev}: line 2: label 0.5 in column 'label' is a float"
    )


def test_validation_integer_label_unseen_in_training_keeps_its_message(cli, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    train = _jsonl(tmp_path / "train.jsonl", [0, 1, 0, 1])
    dev = _jsonl(tmp_path / "dev.jsonl", [0, 7])
    _assert_refused(
        cli, tmp_path, tiny_model, train, dev, "has label 7, never seen in the training data (labels: 0, 1)"
    )


@pytest.fixture
def small_csv_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Fault injection: a csv field limit a row exceeds, restored afterwards (it is process-wide)."""
    before = csv.field_size_limit()
    monkeypatch.setattr(data_module, "CSV_FIELD_LIMIT", 100)
    csv.field_size_limit(100)
    yield 100
    csv.field_size_limit(before)


def test_csv_reader_error_is_one_line_naming_file_and_line(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, tiny_model: Path, small_csv_limit: int
) -> None:
    train = tmp_path / "train.csv"
    train.write_text("text,label\nshort,0\nalso short,1\n" + "x" * 500 + ",1\n")
    dev = _csv(tmp_path / "dev.csv", ["0", "1"])
    _assert_refused(
        cli, tmp_path, tiny_model, train, dev, f"data file {train}: line 4 cannot be read as CSV (field larger"
    )


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_long_text_field_is_read_and_truncated(tmp_path: Path, tiny_model: Path, suffix: str) -> None:
    """A 200,000-character text (beyond csv's default 131,072 limit) is legitimate: it is cut to max_length."""
    long_text = "word " * 40_000
    sep = "," if suffix == ".csv" else "\t"
    train = tmp_path / f"train{suffix}"
    train.write_text(f"text{sep}label\n{long_text}{sep}0\nshort{sep}1\n")
    dev = tmp_path / f"dev{suffix}"
    dev.write_text(f"text{sep}label\nfine{sep}0\nok{sep}1\n")
    cfg = DataConfig(train=str(train), validation=str(dev))
    splits = read_splits(cfg)
    assert len(splits.train.texts[0]) == 200_000
    assert splits.labels is not None and splits.labels.names == ("0", "1") and splits.labels.numeric
    prepared = prepare(cfg, load_tokenizer(str(tiny_model)), 32, None)
    assert max(prepared.train.lengths) == 32 and prepared.train.labels == [0, 1]


def test_integer_labels_zero_to_k_minus_one_are_accepted(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [2, 0, 1, 2])
    dev = _jsonl(tmp_path / "dev.jsonl", [1, "2"])
    splits = read_splits(DataConfig(train=str(train), validation=str(dev)))
    assert splits.labels is not None
    assert splits.labels.names == ("0", "1", "2") and splits.labels.numeric
    assert splits.labels.encode(splits.validation.labels, dev) == [1, 2]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "train_labels,dev_labels,names,dev_ids",
    [
        ([5, 1, 2, 3, 4, 1], [1, "5", 3], ("1", "2", "3", "4", "5"), [0, 4, 2]),  # star ratings
        ([-1, 0, 1, 0], [1, -1], ("-1", "0", "1"), [2, 0]),  # negative / neutral / positive
    ],
    ids=["one_to_five", "minus_one_to_one"],
)
def test_consecutive_integer_labels_keep_their_values(
    tmp_path: Path, train_labels: list[int], dev_labels: list[Any], names: tuple[str, ...], dev_ids: list[int]
) -> None:
    """Ids follow the values' order; id2label (saved in every checkpoint's config) gives the values back."""
    train = _jsonl(tmp_path / "train.jsonl", train_labels)
    dev = _jsonl(tmp_path / "dev.jsonl", dev_labels)
    splits = read_splits(DataConfig(train=str(train), validation=str(dev)))
    assert splits.labels is not None and splits.labels.numeric
    assert splits.labels.names == names
    assert splits.labels.encode(splits.validation.labels, dev) == dev_ids  # type: ignore[union-attr]
    assert splits.labels.id2label() == dict(enumerate(names))


def test_csv_quoted_line_breaks_are_kept_and_later_lines_numbered_right(tmp_path: Path) -> None:
    """A quoted field may span lines: its text keeps the break, and a bad row after it is named
    by the line it sits on in an editor, not by its row count."""
    train = tmp_path / "train.csv"
    train.write_text('text,label\n"two\nlines",0\n"a\r\nthird",1\nparagraph\u2028separator\x85inside,0\nbad row\n')
    with pytest.raises(data_module.DataError, match=r"train.csv: line 7 has 1 fields, the header has 2"):
        data_module.read_rows(train, "text", "label")
    train.write_text(train.read_text().replace("bad row\n", ""))
    rows = data_module.read_rows(train, "text", "label")
    assert rows.texts == [
        "two\nlines",
        "a\nthird",  # read_text makes every line end \n
        "paragraph\u2028separator\x85inside",
    ]
    assert rows.labels == ["0", "1", "0"]


def test_unterminated_quote_names_the_line_it_starts_on(tmp_path: Path) -> None:
    train = tmp_path / "train.csv"
    train.write_text('text,label\nfine,0\n"never closed,1\nmore,0\n')
    with pytest.raises(
        data_module.DataError,
        match=r"train.csv: line 3 has 1 fields, the header has 2 "
        r"\(a quoted field runs on to line 4: is a closing quote missing\?\)",
    ):
        data_module.read_rows(train, "text", "label")
