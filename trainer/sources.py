"""Where a study's rows come from: a data file in a format users keep (JSON lines, a JSON list, CSV, TSV, Parquet,
Arrow; each optionally gzipped), a `datasets` ``save_to_disk`` folder, or a hub dataset id read from the local Hugging
Face cache (or through ``HF_ENDPOINT``). Each split becomes (row number, row) records, with dotted columns
("review.text") lifted out of nested fields; checking them into examples is reading.py's (docs/data.md)."""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.storage import regular
from hpsearch.trainer import conll
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.holdout import hold_out
from hpsearch.trainer.reading import (
    DataError,
    Records,
    file_format,
    parse_jsonl,
    parse_table,
    short,
)

log = logging.getLogger(__name__)

FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".arrow")
READ = ".jsonl, .json, .csv, .tsv, .parquet or .arrow (each optionally .gz)"
"""The formats in words, for every refusal."""
_TO_PARQUET = "convert it, e.g. with pandas: {}.to_parquet('data.parquet')"
CONVERT = {
    ".xlsx": _TO_PARQUET.format("pandas.read_excel('FILE')"),
    ".xls": _TO_PARQUET.format("pandas.read_excel('FILE')"),
    ".ods": _TO_PARQUET.format("pandas.read_excel('FILE')"),
    ".feather": "a Feather (v2) file is an Arrow file: rename it to .arrow",
    ".ndjson": "it is JSON lines: rename it to .jsonl",
    ".txt": 'write one {"text": ...} object a line as .jsonl, or a .csv with a header row',
    ".pkl": "hpsearch never unpickles data (it could run code); " + _TO_PARQUET.format("pandas.read_pickle('FILE')"),
    ".pickle": "hpsearch never unpickles data (it could run code); " + _TO_PARQUET.format("pandas.read_pickle('FILE')"),
    ".zip": "unzip it and point at the file inside",
    ".bz2": "recompress it with gzip (.gz)",
    ".xz": "recompress it with gzip (.gz)",
    ".zst": "recompress it with gzip (.gz)",
}
"""A close miss: how to turn it into a format hpsearch reads."""
SAVED = ("dataset_dict.json", "state.json")
"""What marks a folder `datasets` save_to_disk wrote: a DatasetDict's index of splits, a single Dataset's state."""
COLUMN_KEYS = (
    "text_column",
    "label_column",
    "text_pair_column",
    "prompt_column",
    "response_column",
    "messages_column",
)


@dataclass(frozen=True)
class Source:
    """One split's rows and the name every message about them gives: the file, or the dataset's split."""

    records: Records
    path: Path


def read(cfg: DataConfig, stratify: bool) -> tuple[Source, Source]:
    """The training and validation rows ``cfg`` names. With ``data.validation_fraction``, the validation rows are a
    seeded share of the training rows (stratified by label when ``stratify``: classification), taken out of them."""
    train = _with_columns(_split(cfg, "train"), cfg)
    if cfg.validation_fraction:
        label = cfg.label_column if stratify else None
        kept, held = hold_out(train.records, cfg.validation_fraction, cfg.split_seed, label, train.path)
        return Source(kept, train.path), Source(held, train.path)
    return train, _with_columns(_split(cfg, "validation"), cfg)


def names(cfg: DataConfig) -> tuple[str, str]:
    """How messages about the whole of each split name it (e.g. how many of its rows were left out)."""
    if cfg.dataset:
        train = f"{cfg.dataset} (split {cfg.train_split})"
        validation = cfg.validation or f"{cfg.dataset} (split {cfg.validation_split})"
    else:
        train, validation = cfg.train, cfg.validation
    if cfg.validation_fraction:
        validation = f"{train} (the data.validation_fraction {cfg.validation_fraction:g} held out)"
    return train, validation


def files(cfg: DataConfig) -> list[Path]:
    """Every file whose bytes make the data: what the token cache's key hashes, and whose permissions the files
    derived from the data keep (encoding.data_mode)."""
    out = [Path(cfg.train)] if cfg.train else []
    if cfg.validation:
        out.append(Path(cfg.validation))
    if cfg.dataset:
        folder = Path(cfg.dataset)
        if folder.is_dir():
            out += sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
        else:  # a hub id: the cache's Arrow files of every split
            loaded = _load_dataset(cfg.dataset)
            for split in loaded.values() if hasattr(loaded, "values") else [loaded]:
                out += [Path(f["filename"]) for f in split.cache_files]
    return out


def digest(cfg: DataConfig) -> str:
    """The data's bytes, hashed: the same data at another path shares one token cache."""
    h = hashlib.sha256()
    for path in files(cfg):
        with regular.open_file(path, "rb", follow=True) as f:  # a FIFO named as data is refused, not read
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _split(cfg: DataConfig, which: str) -> Source:
    file = cfg.train if which == "train" else cfg.validation
    if file:
        path = Path(file)
        if path.suffix.lower() == conll.SUFFIX:  # token-classification's sentences, one row a sentence
            return Source(conll.read_records(path, cfg.text_column, cfg.label_column), path)
        return Source(read_file(path, cfg.header), path)
    name = cfg.train_split if which == "train" else cfg.validation_split
    return _dataset_split(cfg.dataset, name, which)


# ---- files ----------------------------------------------------------------------------------------------------------


def read_file(path: Path, header: bool = True) -> Records:
    """(line or row number, row) of a data file in any of :data:`FORMATS`, optionally gzipped; at least one row, or
    a DataError naming the file and the fix. A .csv/.tsv row is keyed by the header's names, or by position without
    a header."""
    fmt = file_format(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist; check the path in the spec's [data] table")
    if path.is_dir():
        raise DataError(_folder_refusal(path))
    if fmt not in FORMATS:
        how = CONVERT.get(fmt, "")
        raise DataError(
            f"data file {path}: unsupported format {fmt or path.name!r}; hpsearch reads {READ}, a `datasets` "
            f"save_to_disk folder or a hub dataset id (data.dataset){'; ' + how if how else ''}"
        )
    raw = _raw_bytes(path)
    if fmt in (".parquet", ".arrow"):
        records = _table_records(raw, path, fmt)
    else:
        text = _text(raw, path)
        if fmt == ".json":
            records = _json_records(text, path)
        elif fmt == ".jsonl":
            records = parse_jsonl(text, path)
        else:
            records = parse_table(text, path, fmt, header)
    if not records:
        needs = "a header and at least one example" if header and fmt in (".csv", ".tsv") else "at least one example"
        raise DataError(f"data file {path} has no rows; it needs {needs}")
    return records


def _folder_refusal(path: Path) -> str:
    if any((path / marker).is_file() for marker in SAVED):
        return (
            f"data file {path} is a `datasets` save_to_disk folder; set data.dataset = {str(path)!r} (and "
            "data.train_split / data.validation_split) instead of data.train / data.validation"
        )
    kinds = sorted({file_format(p) or p.name for p in path.iterdir() if p.is_file()})
    inside = f" (it holds {', '.join(kinds[:6])} files)" if kinds else ""
    return (
        f"data file {path} is a folder{inside}; point data.train / data.validation at one file ({READ}), or join the "
        "files into a `datasets` folder (datasets.load_dataset('parquet', data_files='FOLDER/*.parquet')"
        ".save_to_disk('data')) and set data.dataset to it"
    )


def _raw_bytes(path: Path) -> bytes:
    try:
        # Opened without blocking and checked to be a regular file: a FIFO named as data would hang `start`.
        with regular.open_file(path, "rb", follow=True) as f:
            raw = f.read()
    except regular.NotRegularFile as exc:
        raise DataError(f"data file {exc}; point [data] at a {READ} file") from None
    if path.name.lower().endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(
                f"data file {path} is not whole gzip data ({exc}); compress it again with gzip, or drop the .gz"
            ) from None
    return raw


def _text(raw: bytes, path: Path) -> str:
    """UTF-8, with or without a byte-order mark; UTF-16 with one (Excel's "Unicode text", PowerShell's default)."""
    encoding = "utf-16" if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "utf-8-sig"
    try:
        # Read as open() reads text (universal newlines): \r\n and \r become \n, inside quoted fields too.
        return io.TextIOWrapper(io.BytesIO(raw), encoding=encoding).read()
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path} is not UTF-8 (bad byte at offset {exc.start}); re-save it as UTF-8"
        ) from None


def _json_records(text: str, path: Path) -> Records:
    """A .json file holds a list of row objects; one that holds JSON lines instead is read as such (as `datasets`
    does: many exports name JSON lines .json)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one value, then more: JSON lines
            return parse_jsonl(text, path)
        raise DataError(f"data file {path}: line {exc.lineno} is not valid JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise DataError(f"data file {path} cannot be read as JSON ({short(str(exc), 80)})") from None
    if isinstance(value, dict):
        value = [value]  # a one-row file written as JSON lines
    if not isinstance(value, list):
        raise DataError(f"data file {path} must hold a list of rows ([{{...}}, ...]), not {type(value).__name__}")
    for number, row in enumerate(value, start=1):
        if not isinstance(row, dict):
            raise DataError(f"data file {path}: row {number} must be a JSON object, got {short(json.dumps(row))}")
    return list(enumerate(value, start=1))


def _table_records(raw: bytes, path: Path, fmt: str) -> Records:
    import pyarrow as pa
    import pyarrow.parquet as pq

    what = "Parquet" if fmt == ".parquet" else "Arrow"
    try:
        if fmt == ".parquet":
            table = pq.read_table(pa.BufferReader(raw))
        else:
            # The Arrow file format, or the stream format that `datasets` writes (data-00000-of-00001.arrow).
            try:
                table = pa.ipc.open_file(pa.BufferReader(raw)).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(pa.BufferReader(raw)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(
            f"data file {path} cannot be read as {what} ({short(str(exc), 100)}); export it again as {what}"
        ) from None
    return list(enumerate(table.to_pylist(), start=1))


# ---- `datasets` folders and hub ids ---------------------------------------------------------------------------------


def _dataset_split(name: str, split: str, which: str) -> Source:
    loaded = _load_dataset(name)
    if hasattr(loaded, "keys"):  # a DatasetDict
        if split not in loaded:
            key = "train_split" if which == "train" else "validation_split"
            also = (
                "" if which == "train" else ", or data.validation_fraction = 0.1 to hold out a share of the train rows"
            )
            raise DataError(
                f"data.dataset {name}: has no split {split!r} (splits: {', '.join(loaded.keys())}); set "
                f"data.{key} to one of them{also}"
            )
        dataset, where = loaded[split], Path(name) / split
    elif which == "train":
        dataset, where = loaded, Path(name)
    else:
        raise DataError(
            f"data.dataset {name}: is one Dataset, without splits, so it holds no validation rows; set "
            "data.validation_fraction (e.g. 0.1) to hold out a share, or data.validation to a file"
        )
    records = list(enumerate(dataset.to_list(), start=1))
    if not records:
        raise DataError(f"data.dataset {name}: split {split!r} has no rows; it needs at least one example")
    return Source(records, where)


def _load_dataset(name: str) -> Any:
    """A save_to_disk folder (Dataset or DatasetDict), else a hub dataset id from the cache: each memory-mapped."""
    import datasets

    datasets.disable_progress_bars()  # a bar per split in the log of every worker says nothing
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / marker).is_file() for marker in SAVED):
            raise DataError(
                f"data.dataset {name}: is a folder, but not one `datasets` save_to_disk wrote (no "
                f"{' or '.join(SAVED)}); save it with Dataset.save_to_disk / DatasetDict.save_to_disk, or point "
                f"data.train at a file ({READ})"
            )
        try:
            return datasets.load_from_disk(str(path))
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"data.dataset {name}: cannot be loaded ({short(str(exc), 100)}); save it again") from None
    if name.startswith(("/", ".", "~")) or path.exists():
        raise DataError(f"data.dataset {name}: no such folder; check the path (relative to the spec file)")
    try:
        return datasets.load_dataset(name)
    except Exception as exc:  # the hub's and the cache's errors are many (offline, not found, gated): each one line
        raise DataError(
            f"data.dataset {name}: not a folder here, and not readable as a hub dataset "
            f"({type(exc).__name__}: {short(str(exc), 100)}); download it once on this host "
            f"(datasets.load_dataset({name!r}), with HF_ENDPOINT for a mirror) or give a save_to_disk folder"
        ) from None


# ---- nested columns -------------------------------------------------------------------------------------------------


def _with_columns(source: Source, cfg: DataConfig) -> Source:
    """Lift each dotted column ("review.text", "turns.0.text") out of its nested field into a key of its own, where
    the row has no key of that very name: the readers then treat it as any column."""
    dotted = [c for c in (getattr(cfg, k) for k in COLUMN_KEYS) if isinstance(c, str) and "." in c]
    for _, record in source.records if dotted else ():
        for column in dotted:
            if column not in record:
                found, value = _lookup(record, column.split("."))
                if found:
                    record[column] = value
    return source


def _lookup(value: Any, parts: Iterable[str]) -> tuple[bool, Any]:
    for part in parts:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return False, None
    return True, value
