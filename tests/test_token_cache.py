"""The token cache as Arrow files, memory-mapped (issue 58, item 5): what a worker maps is what tokenising gives,
tokenised a piece at a time, read without copying the ids into the worker, and a damaged or foreign entry is
refused and rebuilt, never read blindly."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from hpsearch.trainer import token_cache
from hpsearch.trainer.batching import collate, eval_batches
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.encoding import keep, prepare
from hpsearch.trainer.mapped import Mapped
from hpsearch.trainer.model import load_tokenizer
from hpsearch.trainer.task_names import IGNORE_INDEX


@pytest.fixture
def cfg(demo_files: tuple[Path, Path]) -> DataConfig:
    return DataConfig(train=str(demo_files[0]), validation=str(demo_files[1]))


def _entry(cache: Path) -> Path:
    [meta] = cache.glob("tokens-*/meta.json")
    return meta.parent


def test_mapped_splits_hold_what_the_tokenizer_gives_in_pieces(
    tiny_model: Path, cfg: DataConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = load_tokenizer(str(tiny_model))
    texts = [json.loads(line)["text"] for line in Path(cfg.train).read_text().splitlines()]
    expected = tok(texts, truncation=True, max_length=32)["input_ids"]
    monkeypatch.setattr(token_cache, "CHUNK_ROWS", 7)  # many record batches, a short last one
    prepared = prepare(cfg, tok, 32, tmp_path / "cache")
    train = prepared.train
    assert isinstance(train.input_ids, Mapped) and isinstance(train.labels, Mapped)
    assert len(train) == len(texts) and list(train.input_ids) == expected
    assert [train.input_ids[i] for i in (0, 6, 7, 13, 14, len(texts) - 1, -1)] == [
        expected[i] for i in (0, 6, 7, 13, 14, len(texts) - 1, -1)
    ]
    assert list(train.lengths) == [len(x) for x in expected]
    with pa.ipc.open_file(_entry(tmp_path / "cache") / "train.arrow") as f:
        assert f.num_record_batches == -(-len(texts) // 7)
    # The ids are views of the read-only mapped file, not copies in this process.
    for values in train.input_ids._values:
        assert not values.flags.owndata and not values.flags.writeable
    # A batch across a piece boundary pads as one built from lists does.
    batch = collate(train, [5, 6, 7, 8], prepared.pad_id)
    width = max(len(expected[i]) for i in (5, 6, 7, 8))
    assert batch["input_ids"].tolist() == [
        expected[i] + [prepared.pad_id] * (width - len(expected[i])) for i in (5, 6, 7, 8)
    ]
    assert batch["labels"].tolist() == [train.labels[i] for i in (5, 6, 7, 8)]
    # The same read again: a hit, nothing tokenised, the same rows; a subset is plain lists.
    again = prepare(cfg, tok, 32, tmp_path / "cache")
    assert again.train.input_ids == train.input_ids and again.validation.labels == prepared.validation.labels
    picked = again.validation.subset([3, 1])
    assert picked.input_ids == [prepared.validation.input_ids[3], prepared.validation.input_ids[1]]
    assert sum(map(len, eval_batches(again.validation.lengths, 16))) == len(again.validation)


def test_counts_of_labelled_tokens_from_the_mapped_offsets_match_a_count_by_hand() -> None:
    rng = random.Random(3)
    rows = [[rng.choice([IGNORE_INDEX, 4, 9]) for _ in range(rng.randrange(0, 9))] for _ in range(500)]
    table = pa.Table.from_batches(
        [
            pa.RecordBatch.from_pydict({"x": rows[i : i + 64]}, pa.schema([("x", pa.list_(pa.int32()))]))
            for i in range(0, 500, 64)
        ]
    )
    column = Mapped(table["x"])
    for start in (0, 1):
        assert list(column.counts_not(IGNORE_INDEX, start)) == [sum(v != IGNORE_INDEX for v in r[start:]) for r in rows]
    assert list(column.row_lengths()) == [len(r) for r in rows] and column[100:103] == rows[100:103]


def test_start_tokenises_privately_and_keep_writes_the_same_entry(
    tiny_model: Path, cfg: DataConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    tok = load_tokenizer(str(tiny_model))
    cache = tmp_path / "runs" / "token-cache"
    checked = prepare(cfg, tok, 32, cache, write=False)
    assert not (tmp_path / "runs").exists(), "a start that may still fail wrote something"
    assert list((tmp_path / "tmp").iterdir()) == [], "the private copy was left behind"
    assert isinstance(checked.train.input_ids, Mapped) and len(checked.train) == 320  # mapped from deleted files
    keep(checked, cfg, tok, 32, cache)
    entry = _entry(cache)
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "train.arrow", "validation.arrow"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"
    worker = prepare(cfg, tok, 32, cache)
    assert worker.train.input_ids == checked.train.input_ids and worker.labels == checked.labels


def _damage_offsets(path: Path) -> None:
    """Rewrite a split with an input_ids offset far past the end of its values (as a hostile file could)."""
    with pa.ipc.open_file(path) as f:
        table = f.read_all()
    ids = table["input_ids"].combine_chunks()
    offsets = ids.offsets.to_numpy().copy()
    offsets[5] = 1 << 30  # the ends agree: only a full validation sees it
    bad = pa.ListArray.from_buffers(
        ids.type, len(ids), [None, pa.py_buffer(offsets.astype(np.int32).tobytes())], children=[ids.values]
    )
    columns = [bad if name == "input_ids" else table[name].combine_chunks() for name in table.column_names]
    os.unlink(path)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(columns, table.column_names))


@pytest.mark.parametrize(
    "damage",
    ["truncated", "offsets", "wrong_type", "foreign", "rows", "link", "file"],
)
def test_a_damaged_or_foreign_entry_is_refused_and_rebuilt(
    damage: str, tiny_model: Path, cfg: DataConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tok = load_tokenizer(str(tiny_model))
    cache = tmp_path / "cache"
    first = prepare(cfg, tok, 32, cache)
    expected = list(first.train.input_ids)
    entry = _entry(cache)
    train, meta = entry / "train.arrow", entry / "meta.json"
    if damage == "truncated":
        data = train.read_bytes()
        os.unlink(train)
        train.write_bytes(data[: len(data) // 2])
    elif damage == "offsets":
        _damage_offsets(train)
    elif damage == "wrong_type":  # the ids as 64-bit floats
        with pa.ipc.open_file(train) as f:
            table = f.read_all()
        table = table.set_column(0, "input_ids", table["input_ids"].cast(pa.list_(pa.float64())))
        os.unlink(train)
        with pa.OSFile(str(train), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    elif damage == "foreign":  # another entry's meta (other inputs) copied in
        raw = json.loads(meta.read_text())
        raw["key"] = "0" * 24
        meta.write_text(json.dumps(raw))
    elif damage == "rows":
        raw = json.loads(meta.read_text())
        raw["splits"]["train"]["rows"] += 1
        meta.write_text(json.dumps(raw))
    elif damage == "link":  # the entry swapped for a link to a copy elsewhere
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(entry, elsewhere)
        shutil.rmtree(entry)
        entry.symlink_to(elsewhere)
    else:  # a plain file where the entry's folder belongs
        shutil.rmtree(entry)
        entry.write_text("not a cache")
    caplog.set_level(logging.WARNING, "hpsearch.trainer.token_cache")
    again = prepare(cfg, tok, 32, cache)
    assert list(again.train.input_ids) == expected
    assert any("is unreadable" in r.getMessage() and "tokenising again" in r.getMessage() for r in caplog.records)
    rebuilt = _entry(cache)
    assert rebuilt.is_dir() and not rebuilt.is_symlink()
    if damage == "link":
        assert (tmp_path / "elsewhere" / "meta.json").exists(), "the link was followed"
    assert token_cache.load(rebuilt, json.loads((rebuilt / "meta.json").read_text())["key"]) is not None
    assert sorted(p.name for p in cache.iterdir()) == sorted([rebuilt.name, rebuilt.name + ".lock"])


def test_with_no_temporary_disk_the_splits_are_tokenised_into_memory(
    tiny_model: Path, cfg: DataConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import tempfile

    tok = load_tokenizer(str(tiny_model))
    mapped = prepare(cfg, tok, 32, None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
    monkeypatch.setattr(token_cache, "CHUNK_ROWS", 50)  # the pieces joined again
    caplog.set_level(logging.WARNING, "hpsearch.trainer.encoding")
    held = prepare(cfg, tok, 32, None)
    assert isinstance(held.train.input_ids, list) and held.train.input_ids == list(mapped.train.input_ids)
    assert held.validation.labels == list(mapped.validation.labels) and held.labels == mapped.labels
    assert any("held in memory" in r.getMessage() for r in caplog.records)
