"""The token cache on disk: a task's tokenised splits as Arrow IPC files, written once per study and host and
memory-mapped by every worker, so that a worker's memory does not grow with the data (docs/data.md, "Big files").

An entry is a folder ``tokens-<key>/`` holding ``train.arrow``, ``validation.arrow`` and ``meta.json`` (what the
splits are: task, labels, padding id, row counts, rows left out). It is built under a private name and renamed into
place whole: a reader sees no entry or a complete one. The folder may sit on a shared disk, so an entry is input:
its meta is JSON checked field by field, its files are opened through no link, their schema, row counts and
offsets are checked (``validate(full=True)``: an offset past the end would read outside the file) before any row is
used; anything else is refused and rebuilt (docs/decisions.md, "No pickle from disk")."""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpsearch.storage import regular
from hpsearch.trainer.labels import LabelMap
from hpsearch.trainer.mapped import Mapped
from hpsearch.trainer.tokenised import Encoded, Prepared

log = logging.getLogger(__name__)

# Raised whenever reading or encoding yields other examples from the same file, so no host reuses tokens the
# current code would not produce (4: CSV quoted fields keep their line breaks; 5: JSON, not pickle; 6: chat data;
# 7: causal-lm rows with nothing to train on within max_length are left out and their lines kept; 8: regression,
# multi-label and token-classification, sentence pairs; 9: Arrow files, memory-mapped).
CACHE_VERSION = 9
CHUNK_ROWS = 8192
"""Rows tokenised and written at a time: what tokenising holds in Python lists, whatever the file's size."""
SPLITS = ("train", "validation")
META_LIMIT = 64 << 20
"""meta.json is small (its largest part: the line numbers of rows left out); a planted one must not fill memory."""


def _types(narrow: bool = False) -> dict[str, Any]:
    """Each Encoded field a split may hold, with its Arrow type; a split stores those it uses (a classifier has no
    token_labels). ``narrow``: token ids as 2 bytes (a vocabulary of at most 65,536), half the file and the pages
    each worker maps."""
    import pyarrow as pa

    return {
        "input_ids": pa.list_(pa.uint16() if narrow else pa.int32()),
        "labels": pa.int64(),
        "prompt_lengths": pa.int32(),
        "token_labels": pa.list_(pa.int32()),
        "scores": pa.list_(pa.float64()),
        "token_type_ids": pa.list_(pa.int32()),
    }


def entry(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"tokens-{key}"


def chunks(split: Encoded) -> Iterator[Encoded]:
    """A split in pieces of CHUNK_ROWS rows, as plain lists (for writing one already in memory or mapped)."""
    for start in range(0, len(split), CHUNK_ROWS):
        stop = start + CHUNK_ROWS
        yield Encoded(
            list(split.input_ids[start:stop]),
            list(split.labels[start:stop]),
            list(split.prompt_lengths[start:stop]),
            list(split.token_labels[start:stop]),
            split.task,
            scores=list(split.scores[start:stop]),
            token_type_ids=list(split.token_type_ids[start:stop]),
        )


def narrow_ids(tokenizer: Any) -> bool:
    """Whether every id ``tokenizer`` gives fits in 2 bytes (BERT's 30,522, GPT-2's 50,257; not Llama 3's 128,256)."""
    try:
        return 0 < len(tokenizer) <= 1 << 16
    except TypeError:  # no length to go by
        return False


def build(
    folder: Path, key: str, prepared: Prepared, pieces: dict[str, Iterable[Encoded]], mode: int, narrow: bool
) -> tuple[Path, Prepared]:
    """Write an entry under a private name in ``folder`` from each split's ``pieces`` (consumed one at a time: the
    whole split is never in memory), and map it back. ``prepared`` gives what the splits share (labels, padding
    id, task); the returned Prepared is mapped from the files written. The caller publishes or removes the folder."""
    tmp = folder / f".tokens-{key}.{uuid.uuid4().hex[:8]}"
    regular.check_unmoved(tmp)
    folder.mkdir(parents=True, exist_ok=True)
    # The folder's mode follows its files': searchable by whoever may read them.
    os.mkdir(tmp, mode | ((mode & 0o444) >> 2))
    try:
        splits = {name: _write_split(tmp / f"{name}.arrow", pieces[name], mode, narrow) for name in SPLITS}
        labels = None
        if prepared.labels is not None:
            labels = {"names": list(prepared.labels.names), "numeric": prepared.labels.numeric}
            labels["task"] = prepared.labels.task
        meta = {"version": CACHE_VERSION, "key": key, "task": prepared.task, "pad_id": prepared.pad_id}
        meta |= {"labels": labels, "splits": splits}
        with regular.create_new(tmp / "meta.json", mode) as f:
            json.dump(meta, f, separators=(",", ":"))
        mapped = load(tmp, key)
        if mapped is None:
            raise OSError(errno.EIO, f"the token cache just written to {tmp} does not read back")
        return tmp, mapped
    except BaseException:
        regular.remove(tmp)
        raise


def _write_split(path: Path, pieces: Iterable[Encoded], mode: int, narrow: bool) -> dict[str, Any]:
    import pyarrow as pa

    types = _types(narrow)
    rows, task, dropped = 0, None, []
    writer, sink = None, regular.create_new(path, mode, binary=True)
    with sink:
        for piece in pieces:
            task = piece.task
            dropped += piece.dropped
            if not len(piece):
                continue  # every row of this piece was left out
            names = [name for name in types if len(getattr(piece, name))]
            batch = pa.RecordBatch.from_arrays([pa.array(getattr(piece, n), type=types[n]) for n in names], names)
            if writer is None:
                writer = pa.ipc.new_file(sink, batch.schema)
            writer.write_batch(batch)  # raises on a piece with other columns than the first: a bug, not data
            rows += len(piece)
        if writer is None:  # no row at all: check_dropped refuses the split
            writer = pa.ipc.new_file(sink, pa.schema([("input_ids", types["input_ids"])]))
        writer.close()
    return {"rows": rows, "task": task, "dropped": dropped}


def publish(tmp: Path, path: Path) -> None:
    """Rename a built entry into place, replacing whatever is there (a damaged entry, a planted file or link:
    renamed away and deleted, never written through). A worker still reading an old entry keeps its mapped files."""
    regular.check_unmoved(path)
    if os.path.lexists(path):
        old = path.with_name(f".{path.name}.old.{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        regular.remove(old)
    try:
        os.rename(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        regular.remove(tmp)  # another host's worker on a shared disk renamed its own in first: the same tokens


def load(path: Path, key: str) -> Prepared | None:
    """The entry at ``path`` mapped, or None where there is none (or it is refused: logged, then rebuilt)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISDIR(found.st_mode):
            raise ValueError(f"it is {regular.kind(found.st_mode)}, not a folder")
        meta = json.loads(regular.read_text(path / "meta.json", META_LIMIT))
        prepared = _from_meta(meta, key, {name: _map(path / f"{name}.arrow") for name in SPLITS})
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("token cache %s is unreadable (%s); tokenising again", path, exc)
        return None
    return prepared


def _map(path: Path) -> Any:
    """A split's table, its buffers views of the file mapped read-only (opened through no link: a FIFO or a link
    there is refused), its schema and offsets checked."""
    import pyarrow as pa

    with regular.open_file(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path.name} is empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the descriptor
    table = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapped))).read_all()
    types, narrow = _types(), _types(narrow=True)
    for name, column in zip(table.column_names, table.columns, strict=True):
        if column.type not in (types.get(name), narrow.get(name)):
            raise ValueError(f"{path.name}: column {name!r} of type {column.type} is not one hpsearch writes")
        if column.null_count:
            raise ValueError(f"{path.name}: column {name!r} has missing values")
    if "input_ids" not in table.column_names:
        raise ValueError(f"{path.name} has no input_ids")
    table.validate(full=True)  # raises ArrowInvalid (a ValueError) on offsets past the end of their values
    return table


def _from_meta(meta: Any, key: str, tables: dict[str, Any]) -> Prepared:
    """Rebuild a Prepared from the meta and the mapped tables, checking every field's type (a ValueError
    otherwise)."""
    if not isinstance(meta, dict) or meta.get("version") != CACHE_VERSION:
        raise ValueError("another cache version")
    if meta.get("key") != key:
        raise ValueError("it was written for other inputs")

    def ints(value: Any) -> list[int]:
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ValueError("not a list of integers")
        return value

    def split(name: str) -> Encoded:
        info, table = meta["splits"][name], tables[name]
        if type(info["rows"]) is not int or info["rows"] != table.num_rows:
            raise ValueError(f"{name}.arrow holds {table.num_rows} rows, not the {info['rows']} its meta says")
        columns = {n: Mapped(table[n]) for n in table.column_names}
        return Encoded(
            input_ids=columns["input_ids"],
            labels=columns.get("labels", []),
            prompt_lengths=columns.get("prompt_lengths", []),
            token_labels=columns.get("token_labels", []),
            task=str(info["task"]),
            dropped=ints(info["dropped"]),
            scores=columns.get("scores", []),
            token_type_ids=columns.get("token_type_ids", []),
        )

    raw = meta["labels"]
    labels = None
    if raw is not None:
        labels = LabelMap(tuple(str(n) for n in raw["names"]), numeric=bool(raw["numeric"]), task=str(raw["task"]))
    if type(meta["pad_id"]) is not int:
        raise ValueError("pad_id is not an integer")
    return Prepared(split("train"), split("validation"), labels, pad_id=meta["pad_id"], task=str(meta["task"]))
