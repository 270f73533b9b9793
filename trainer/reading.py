"""Rows of a data file checked into examples, with errors that name the file, the line (or row) and the fix; the
parsers of the text formats (.jsonl, .csv, .tsv). Which file or folder a split comes from: sources.py."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

LINE_FORMATS = (".jsonl", ".csv", ".tsv", ".conll")
"""Text formats read line by line: their errors name a line; other sources (parquet, arrow, a JSON list, a `datasets`
folder) name a row, counted from 1."""


class DataError(ValueError):
    """A data file is missing, unreadable or inconsistent; the message says which and how."""


@dataclass(frozen=True)
class Rows:
    texts: list[str]
    labels: list[Any]
    path: Path


Column = str | int
"""A column's name, or its position (0 = the first) in a file read with ``header = False``."""
Records = list[tuple[int, dict[Any, Any]]]
"""A file's rows as :func:`read_records` reads them: (line number, row)."""


def read_rows(
    path: Path, text_column: Column, label_column: Column, header: bool = True, records: Records | None = None
) -> Rows:
    """(text, label) pairs of ``records`` (read from ``path`` when None), with errors that say where."""
    keys = {"text_column": text_column, "label_column": label_column}
    if records is None:
        from hpsearch.trainer.sources import read_file  # sources.py builds on this module: imported when used

        records = read_file(path, header)
    _check_columns(path, header, keys, records)
    texts: list[str] = []
    labels: list[Any] = []
    for line_no, record in records:
        for key, column in keys.items():
            if column not in record:
                _missing(path, line_no, record, column, key, header, first=records[0][0] == line_no)
        text, label = record[text_column], record[label_column]
        if not isinstance(text, str):
            raise DataError(f"data file {path}: {at(path, line_no)}: {text_column!r} must be text, got {text!r}")
        if not text.strip():
            # An empty example trains on nothing but [CLS]: a broken export more often than not.
            raise DataError(
                f"data file {path}: {at(path, line_no)}: the text in column {text_column!r} is empty; "
                "fill it or remove the row"
            )
        if label == "":
            raise DataError(f"data file {path}: {at(path, line_no)}: empty label in column {label_column!r}")
        _check_label_type(label, path, line_no, label_column)
        texts.append(text)
        labels.append(label)
    return Rows(texts, labels, path)


def _check_columns(path: Path, header: bool, keys: dict[str, Column], records: Records) -> None:
    """Names go with a header row, positions without one: said before any row is read."""
    if not header and file_format(path) not in (".csv", ".tsv"):
        what = "JSON lines" if file_format(path) == ".jsonl" else "not CSV or TSV"
        raise DataError(
            f"data.header = false: {path} is {what}, whose rows name their keys; "
            "header = false is for .csv and .tsv files"
        )
    for key, column in keys.items():
        if header and isinstance(column, int):
            raise DataError(
                f"data.{key}: {column} is a column position, which needs data.header = false; the first row of "
                f"{path} names the columns ({_columns(records[0][1])}): give one of those names"
            )
        if not header and isinstance(column, str):
            raise DataError(
                f"data.{key}: {column!r} is a column name, but data.header = false: give the column's position "
                "(0 = the first column)"
            )


def _missing(
    path: Path, line_no: int, record: dict[Any, Any], column: Column, key: str, header: bool, first: bool
) -> NoReturn:
    if not header:
        raise DataError(
            f"data file {path}: {at(path, line_no)} has {len(record)} fields, so no column {column} "
            f"(data.{key} counts from 0)"
        )
    why = _not_a_header(list(record)) if first and file_format(path) in (".csv", ".tsv") else None
    if why:
        raise DataError(
            f"data file {path}: its first row does not look like a header ({why}), and has no column {column!r}; "
            "if the file has no header row, set data.header = false and data.text_column / data.label_column "
            "to column positions (0 = the first column)"
        )
    raise DataError(
        f"data file {path}: {row_at(path, line_no)} has no column {column!r} (columns: {_columns(record)}); "
        f"fix the file or set data.{key}"
    )


def _not_a_header(names: list[str]) -> str | None:
    """Why a first row reads like an example rather than column names, or None."""
    for name in names:
        if as_int(name) is not None:
            return f"{short(repr(name))} is a number"
        if len(name) > 40 or len(name.split()) > 4:
            return f"{short(repr(name))} is a sentence"
    if len(set(names)) < len(names):
        return "two columns have the same name"
    return None


def _columns(record: dict[Any, Any]) -> str:
    return short(", ".join(map(str, record)), 120) or "none"


_JSON_KINDS = {bool: "a boolean", float: "a float", list: "a list", dict: "an object", type(None): "null"}


def _check_label_type(label: Any, path: Path, line_no: int, column: Column) -> None:
    """Labels are class names (strings) or class ids (integers): a float or a list (only JSON can hold
    those) would silently become a class of its own (or a huge id range)."""
    if isinstance(label, str) or (isinstance(label, int) and not isinstance(label, bool)):
        return
    kind = _JSON_KINDS.get(type(label), type(label).__name__)
    hint = ""
    if isinstance(label, float) and label.is_integer() and abs(label) < 1e15:
        hint = f" (write {int(label)}, not {short(json.dumps(label))})"
    raise DataError(
        f"data file {path}: {at(path, line_no)}: label {short(json.dumps(label))} in column {column!r} is {kind}; "
        f"labels must be integers or strings{hint}"
    )


def file_format(path: Path) -> str:
    """A data file's format, its suffix less a final ``.gz``: ``.jsonl`` for both ``a.jsonl`` and ``a.jsonl.gz``."""
    name = path.name.lower()
    name = name[: -len(".gz")] if name.endswith(".gz") else name
    return Path(name).suffix


def unit(path: Path) -> str:
    """What a row number counts in ``path``: lines of a text file, rows of the others (sources without lines)."""
    return "line" if file_format(path) in LINE_FORMATS else "row"


def at(path: Path, number: int) -> str:
    """``line 3`` of a text file, ``row 3`` of the others."""
    return f"{unit(path)} {number}"


def row_at(path: Path, number: int) -> str:
    return f"row at {at(path, number)}" if file_format(path) in LINE_FORMATS else at(path, number)


def short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class TextRows:
    """Causal-LM rows: the text trained on, after a prompt that is not (empty for plain text)."""

    prompts: list[str]
    texts: list[str]
    path: Path
    lines: list[int]
    """Each row's line in the file, to name the rows left out after tokenising."""


def read_text_rows(
    path: Path, text_column: Column, prompt_column: Column, response_column: Column, header: bool, records: Records
) -> TextRows:
    """Causal-LM rows: each has ``text_column``, or ``prompt_column`` and ``response_column``."""
    prompts: list[str] = []
    texts: list[str] = []
    lines: list[int] = []
    _check_columns(path, header, {"text_column": text_column}, records)
    for line_no, record in records:
        columns = (text_column,) if text_column in record else (prompt_column, response_column)
        if not all(c in record for c in columns):
            if not header:
                _missing(path, line_no, record, text_column, "text_column", header, first=False)
            raise DataError(
                f"data file {path}: {row_at(path, line_no)} has no column {text_column!r} (nor {prompt_column!r} + "
                f"{response_column!r}; columns: {_columns(record)}); fix the file or set data.text_column "
                "(or data.prompt_column and data.response_column)"
            )
        for column in columns:
            if not isinstance(record[column], str):
                raise DataError(
                    f"data file {path}: {at(path, line_no)}: {column!r} must be text, got {record[column]!r}"
                )
        text = record[columns[-1]]
        if not text.strip():
            raise DataError(
                f"data file {path}: {at(path, line_no)}: {columns[-1]!r} is empty; fill it or remove the row"
            )
        prompts.append(record[prompt_column] if len(columns) == 2 else "")
        texts.append(text)
        lines.append(line_no)
    return TextRows(prompts, texts, path, lines)


def parse_jsonl(raw: str, path: Path) -> Records:
    """(line number, row) of JSON lines text; blank lines are skipped."""
    records = []
    for line_no, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"data file {path}: line {line_no} is not valid JSON ({exc.msg})") from None
        except ValueError as exc:  # e.g. an integer longer than Python's int_max_str_digits
            raise DataError(f"data file {path}: line {line_no} cannot be read ({exc})") from None
        except RecursionError:  # [[[[... thousands deep: the parser recurses once a level
            raise DataError(f"data file {path}: line {line_no} nests too deeply to be a data row") from None
        if not isinstance(record, dict):
            raise DataError(f"data file {path}: line {line_no} must be a JSON object")
        records.append((line_no, record))
    return records


# Long documents are legitimate (truncated to model.max_length when tokenised): lift csv's default
# 131072-character field limit; sys.maxsize overflows a C long on some platforms (Windows), 2**31 - 1 fits everywhere.
CSV_FIELD_LIMIT = 2**31 - 1


def parse_table(raw: str, path: Path, suffix: str, header_row: bool) -> Records:
    """(line number, row) of CSV (``suffix`` ".csv") or TSV text, keyed by the header's names or by position."""
    if csv.field_size_limit() < CSV_FIELD_LIMIT:
        csv.field_size_limit(CSV_FIELD_LIMIT)
    # newline="" hands csv the raw line ends, as its docs require: a quoted field keeps its line breaks, and only
    # \n, \r and \r\n end a line (str.splitlines would also cut at U+2028, U+0085 and form feeds in a sentence).
    source = io.StringIO(raw, newline="")
    # TSV corpora (GLUE among them) contain bare quotes: quoting must be off.
    reader = csv.reader(source, delimiter="\t", quoting=csv.QUOTE_NONE) if suffix == ".tsv" else csv.reader(source)
    header: list[Any] | None = None
    records: Records = []
    line_no = 1  # where the current row starts: a quoted field may span lines
    first = "header"
    try:
        for row in reader:
            if header is None and not header_row and row and any(cell.strip() for cell in row):
                header, first = list(range(len(row))), "first row"  # columns by position
            if header is None:
                header = row
            elif row and any(cell.strip() for cell in row):
                if len(row) != len(header):
                    # csv reads an unclosed quote to the end of the file as one field: say so.
                    hint = ""
                    if reader.line_num > line_no:
                        hint = f" (a quoted field runs on to line {reader.line_num}: is a closing quote missing?)"
                    raise DataError(
                        f"data file {path}: line {line_no} has {len(row)} fields, the {first} has {len(header)}{hint}"
                    )
                records.append((line_no, dict(zip(header, row, strict=True))))
            line_no = reader.line_num + 1
    except csv.Error as exc:
        raise DataError(f"data file {path}: line {line_no} cannot be read as {suffix[1:].upper()} ({exc})") from None
    return records


def as_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    # CSV/TSV cells are always text: "0", "1" are integer labels too. ASCII digits only: str.isdigit() also
    # accepts "²", which int() refuses; ValueError: longer than Python's int_max_str_digits, no class id anyway.
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        with contextlib.suppress(ValueError):
            return int(value.strip())
    return None
