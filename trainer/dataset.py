"""A task's data, read, label-mapped and tokenised once, with an on-disk cache shared by trials."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.data import DataError, Encoded, LabelMap, Rows, read_rows

log = logging.getLogger(__name__)
CACHE_VERSION = 2


@dataclass
class Splits:
    train: Rows
    validation: Rows
    labels: LabelMap


def read_splits(cfg: DataConfig) -> Splits:
    """Read both files and check their labels agree; no tokenizer needed (cheap validation)."""
    train = read_rows(Path(cfg.train), cfg.text_column, cfg.label_column)
    validation = read_rows(Path(cfg.validation), cfg.text_column, cfg.label_column)
    labels = LabelMap.fit(train.labels, train.path)
    labels.encode(validation.labels, validation.path)  # raises on a label unseen in training
    return Splits(train, validation, labels)


@dataclass
class Prepared:
    train: Encoded
    validation: Encoded
    labels: LabelMap
    pad_id: int


def prepare(cfg: DataConfig, tokenizer: Any, max_length: int, cache_dir: Path | None) -> Prepared:
    """Tokenised splits; read from ``cache_dir`` when the same files were tokenised before.

    The cache is keyed by the files' contents, the tokenizer and ``max_length``, so every
    trial and every worker pointing at the same folder shares one tokenisation.
    """
    if cache_dir is None:
        return _tokenise(cfg, tokenizer, max_length)
    key = _cache_key(cfg, tokenizer, max_length)
    path = cache_dir / f"tokens-{key}.pkl"
    cached = _load(path)
    if cached is not None:
        return cached
    # Concurrent first use (several workers start at once): one tokenises under an exclusive
    # lock, the others wait on the lock and then read its file instead of repeating the work.
    with _exclusive(cache_dir / f"tokens-{key}.lock"):
        cached = _load(path)
        if cached is not None:
            return cached
        prepared = _tokenise(cfg, tokenizer, max_length)
        _write_atomic(path, prepared)
    return prepared


def _tokenise(cfg: DataConfig, tokenizer: Any, max_length: int) -> Prepared:
    splits = read_splits(cfg)
    log.info("tokenising %s and %s (max_length %d)", cfg.train, cfg.validation, max_length)
    return Prepared(
        train=_encode(splits.train, splits.labels, tokenizer, max_length),
        validation=_encode(splits.validation, splits.labels, tokenizer, max_length),
        labels=splits.labels,
        pad_id=int(tokenizer.pad_token_id or 0),
    )


def _load(path: Path) -> Prepared | None:
    if not path.exists():
        return None
    try:
        with path.open("rb") as f:
            cached: Prepared = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
        log.warning("token cache %s is unreadable; tokenising again", path)
        return None
    log.info("token cache hit: %s", path)
    return cached


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock between processes on this host; a no-op where flock is unavailable."""
    try:
        import fcntl
    except ImportError:  # not POSIX: fall back to atomic writes alone (duplicate work, still safe)
        yield
        return
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = lock_path.open("a")
    except OSError as exc:
        log.warning("cannot create lock %s (%s); tokenising without it", lock_path, exc)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _encode(rows: Rows, labels: LabelMap, tokenizer: Any, max_length: int) -> Encoded:
    ids = tokenizer(rows.texts, truncation=True, max_length=max_length, return_attention_mask=False)["input_ids"]
    if any(len(x) == 0 for x in ids):
        raise DataError(f"data file {rows.path}: some texts tokenise to nothing")
    return Encoded(input_ids=[list(x) for x in ids], labels=labels.encode(rows.labels, rows.path))


def _cache_key(cfg: DataConfig, tokenizer: Any, max_length: int) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}|{max_length}|{cfg.text_column}|{cfg.label_column}".encode())
    for name in (cfg.train, cfg.validation):
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    h.update(_tokenizer_identity(tokenizer).encode())
    return h.hexdigest()[:24]


def _tokenizer_identity(tokenizer: Any) -> str:
    """The tokenizer's vocabulary and rules, without its call-time state.

    A fast tokenizer's serialisation also holds the truncation/padding settings of its last
    call, so keying on it raw would give a different key once it has tokenised anything.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return repr(tokenizer)
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    return json.dumps(state, sort_keys=True)


def _write_atomic(path: Path, value: Any) -> None:
    # Concurrent first use: every writer renames a complete private file into place, so a
    # reader sees either nothing or a whole cache, never a torn one.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot write token cache %s (%s); continuing without it", path, exc)
