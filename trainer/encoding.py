"""A task's data, read, label-mapped and tokenised once, with an on-disk cache shared by trials."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.storage import regular
from hpsearch.trainer.batching import (
    CAUSAL_LM,
    CLASSIFICATION,
    IGNORE_INDEX,
    MULTI_LABEL,
    REGRESSION,
    TOKEN_CLASSIFICATION,
    Encoded,
)
from hpsearch.trainer.chat import ChatRows, encode_chat, read_chat_rows
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.labels import LabelMap
from hpsearch.trainer.reading import DataError, Rows, TextRows, read_rows, read_text_rows, short, unit
from hpsearch.trainer.sources import Source, digest, files, names, read
from hpsearch.trainer.task_rows import TaskRows, read_task_rows

log = logging.getLogger(__name__)
# Raised whenever reading or encoding yields other examples from the same file, so no host reuses tokens the
# current code would not produce (4: CSV quoted fields keep their line breaks; 5: JSON, not pickle; 6: chat data;
# 7: causal-lm rows with nothing to train on within max_length are left out and their lines kept; 8: regression,
# multi-label and token-classification, sentence pairs).
CACHE_VERSION = 8


@dataclass
class Splits:
    train: Rows | TaskRows | TextRows | ChatRows
    validation: Rows | TaskRows | TextRows | ChatRows
    labels: LabelMap | None
    """Every task but causal-lm: label value <-> class id (a regression's: its one output)."""


def read_splits(cfg: DataConfig, task: str = CLASSIFICATION) -> Splits:
    """Read both splits (sources.py) and check their labels agree; no tokenizer needed (cheap validation)."""
    train_source, validation_source = read(cfg, stratify=task == CLASSIFICATION)
    if task == CAUSAL_LM:
        return Splits(_read_lm(train_source, cfg), _read_lm(validation_source, cfg), None)
    if task == CLASSIFICATION and cfg.text_pair_column == "":
        train, validation = (
            read_rows(s.path, cfg.text_column, cfg.label_column, cfg.header, s.records)
            for s in (train_source, validation_source)
        )
        labels = LabelMap.fit(train.labels, train.path)
        labels.encode(validation.labels, validation.path)  # raises on a label unseen in training
        return Splits(train, validation, labels)
    train_rows, validation_rows = (
        read_task_rows(s.path, s.records, cfg, task) for s in (train_source, validation_source)
    )
    labels = _fit(train_rows, task, cfg)
    _targets(validation_rows, labels)  # raises on a label unseen in training
    return Splits(train_rows, validation_rows, labels)


def _fit(rows: TaskRows, task: str, cfg: DataConfig) -> LabelMap:
    if task == REGRESSION:
        if len(set(rows.labels)) < 2:
            raise DataError(
                f"data.train: every row of {rows.path} has label {rows.labels[0]:g}; a regression needs labels that "
                "vary (a constant is learnt by the bias alone, and correlations with it are undefined)"
            )
        return LabelMap.of_regression(cfg.label_column)
    if task == MULTI_LABEL:
        return LabelMap.fit_sets(rows.labels, rows.path)
    if task == TOKEN_CLASSIFICATION:
        return LabelMap.fit_tags(rows.labels, rows.path)
    return LabelMap.fit(rows.labels, rows.path)


def _targets(rows: TaskRows, labels: LabelMap) -> list[Any]:
    """What each row is trained to predict: a class id, [its number], a multi-hot row, or each word's tag id."""
    if labels.task == REGRESSION:
        return [[float(y)] for y in rows.labels]
    if labels.task == MULTI_LABEL:
        return labels.encode_sets(rows.labels, rows.lines, rows.path)
    if labels.task == TOKEN_CLASSIFICATION:
        return [labels.encode_tags(tags, line, rows.path) for tags, line in zip(rows.labels, rows.lines, strict=True)]
    return labels.encode(rows.labels, rows.path)


def _read_lm(source: Source, cfg: DataConfig) -> TextRows | ChatRows:
    """Chat rows when the split's first row holds ``messages_column``, else text or prompt/response rows."""
    path, records = source.path, source.records
    if cfg.messages_column in records[0][1]:
        return read_chat_rows(path, cfg.messages_column, records)
    return read_text_rows(path, cfg.text_column, cfg.prompt_column, cfg.response_column, cfg.header, records)


@dataclass
class Prepared:
    train: Encoded
    validation: Encoded
    labels: LabelMap | None
    pad_id: int
    task: str = CLASSIFICATION
    mode: int | None = None
    """The permissions for files that hold what the data says (the token cache, a best model's label names): no
    wider than the data files' own (:func:`data_mode`); None: the umask's."""


def data_mode(cfg: DataConfig) -> int:
    """The mode of files derived from ``cfg``'s data: what every data file allows others (read and write bits only),
    and always their owner's read and write; 0600 where a file cannot be looked at. A root-only users.csv must not
    turn into a world-readable token cache or config.json of label names."""
    shared = 0o066
    try:
        for path in files(cfg):
            shared &= os.stat(path).st_mode
    except (OSError, DataError):
        return 0o600
    return 0o600 | shared


def prepare(
    cfg: DataConfig,
    tokenizer: Any,
    max_length: int,
    cache_dir: Path | None,
    task: str = CLASSIFICATION,
    splits: Splits | None = None,
    *,
    write: bool = True,
) -> Prepared:
    """Tokenised splits, shared through ``cache_dir`` by every trial and worker pointing at it (keyed by the
    files' contents, the task, the tokenizer and ``max_length``); ``splits``: as ``read_splits`` read them.
    ``write=False`` reads a cached copy but writes none (a `start` whose other checks may still fail: :func:`keep`
    writes it once the study exists). A file that loses too many rows to ``max_length`` is refused (check_dropped),
    read from the cache or not: the share allowed is no part of the cache's key."""
    if cache_dir is not None and (cache_dir.is_symlink() or not regular.unmoved(cache_dir)):
        # A shared runs folder is input: a link there (or on the way there: an output folder swapped for one) would
        # have the cache written (and read) elsewhere.
        log.warning(
            "not using the token cache %s: it is (or lies behind) a link, and hpsearch writes through none", cache_dir
        )
        cache_dir = None
    mode = data_mode(cfg)
    if cache_dir is None:
        return dataclasses.replace(_tokenise(cfg, tokenizer, max_length, task, splits), mode=mode)
    path = _cache_file(cfg, tokenizer, max_length, task, cache_dir)
    cached = _load(path, cfg, max_length)
    if cached is None and not write:
        cached = _tokenise(cfg, tokenizer, max_length, task, splits)
    if cached is None:
        # Several workers starting at once: one tokenises under an exclusive lock, the others wait and read its file.
        with _exclusive(path.with_suffix(".lock")):
            cached = _load(path, cfg, max_length)
            if cached is None:
                cached = dataclasses.replace(_tokenise(cfg, tokenizer, max_length, task, splits), mode=mode)
                _write_atomic(path, cached)
    return dataclasses.replace(cached, mode=mode)


def keep(prepared: Prepared, cfg: DataConfig, tokenizer: Any, max_length: int, cache_dir: Path) -> None:
    """Write what ``prepare(..., write=False)`` tokenised into ``cache_dir``, unless a copy is there already."""
    if cache_dir.is_symlink() or not regular.unmoved(cache_dir):
        return  # prepare() said so
    path = _cache_file(cfg, tokenizer, max_length, prepared.task, cache_dir)
    if not path.exists():
        _write_atomic(path, prepared)


def _cache_file(cfg: DataConfig, tokenizer: Any, max_length: int, task: str, cache_dir: Path) -> Path:
    return cache_dir / f"tokens-{_cache_key(cfg, tokenizer, max_length, task)}.json"


def _tokenise(cfg: DataConfig, tokenizer: Any, max_length: int, task: str, splits: Splits | None) -> Prepared:
    splits = splits if splits is not None else read_splits(cfg, task)
    log.info("tokenising %s and %s (max_length %d)", *names(cfg), max_length)
    # GPT-style tokenizers have no padding token; padded positions are masked out anyway.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    labels = splits.labels

    def encode(rows: Any) -> Encoded:
        if isinstance(rows, ChatRows):
            return encode_chat(rows, tokenizer, max_length)
        if labels is None:  # causal-lm
            return _encode_text(rows, tokenizer, max_length)
        if isinstance(rows, TaskRows) and labels.task == TOKEN_CLASSIFICATION:
            return _encode_words(rows, labels, tokenizer, max_length)
        if isinstance(rows, TaskRows):
            return _encode_task(rows, labels, tokenizer, max_length)
        return _encode(rows, labels, tokenizer, max_length)

    prepared = Prepared(encode(splits.train), encode(splits.validation), labels, pad_id=int(pad_id or 0), task=task)
    check_dropped(prepared, cfg, max_length)  # before a cache is written for a file that is refused
    return prepared


def _load(path: Path, cfg: DataConfig, max_length: int) -> Prepared | None:
    """The cached tokens, or None (none yet, or unreadable: then tokenised again), checked as freshly tokenised ones
    are (check_dropped). JSON, never pickle: the folder may sit on a shared disk (docs/decisions.md, "No pickle from
    disk")."""
    if not os.path.lexists(path):
        return None
    try:
        # A regular file reached through no link: a FIFO there would hang every worker at its start.
        with regular.open_file(path, "rb") as f:
            cached = _from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("token cache %s is unreadable (%s); tokenising again", path, exc)
        return None
    log.info("token cache hit: %s", path)
    check_dropped(cached, cfg, max_length)
    return cached


def _to_json(p: Prepared) -> dict[str, Any]:
    labels = None
    if p.labels is not None:
        labels = {"names": list(p.labels.names), "numeric": p.labels.numeric, "task": p.labels.task}
    return {
        "version": CACHE_VERSION,
        "task": p.task,
        "pad_id": p.pad_id,
        "labels": labels,
        "train": dataclasses.asdict(p.train),
        "validation": dataclasses.asdict(p.validation),
    }


def _from_json(d: dict[str, Any]) -> Prepared:
    """Rebuild what :func:`_to_json` wrote, checking every field's type (a ValueError otherwise)."""
    if d.get("version") != CACHE_VERSION:
        raise ValueError("another cache version")

    def ints(value: Any) -> list[int]:
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise ValueError("not a list of integers")
        return value

    def floats(value: Any) -> list[float]:
        if not isinstance(value, list) or not all(type(v) is float for v in value):
            raise ValueError("not a list of numbers")
        return value

    def split(e: dict[str, Any]) -> Encoded:
        ids = e["input_ids"]
        if not isinstance(ids, list):
            raise ValueError("input_ids is not a list")
        return Encoded(
            input_ids=[ints(x) for x in ids],
            labels=ints(e["labels"]),
            prompt_lengths=ints(e["prompt_lengths"]),
            token_labels=[ints(x) for x in e["token_labels"]],
            task=str(e["task"]),
            dropped=ints(e["dropped"]),
            scores=[floats(x) for x in e["scores"]],
            token_type_ids=[ints(x) for x in e["token_type_ids"]],
        )

    raw = d["labels"]
    labels = None
    if raw is not None:
        labels = LabelMap(tuple(str(n) for n in raw["names"]), numeric=bool(raw["numeric"]), task=str(raw["task"]))
    return Prepared(
        train=split(d["train"]),
        validation=split(d["validation"]),
        labels=labels,
        pad_id=int(d["pad_id"]),
        task=str(d["task"]),
    )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock between processes on this host."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        # Not through a link, and no FIFO (whose open would wait for a reader): storage/regular.py.
        handle = regular.open_file(lock_path, "a", 0o644)
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


def _encode_task(rows: TaskRows, labels: LabelMap, tokenizer: Any, max_length: int) -> Encoded:
    """Classification (with a sentence pair), regression and multi-label rows: the text, or the pair as the
    tokenizer joins two sentences ([CLS] a [SEP] b [SEP]), the longer one cut first to fit ``max_length``."""
    encoded = tokenizer(rows.texts, rows.pairs, truncation=True, max_length=max_length, return_attention_mask=False)
    ids = [list(x) for x in encoded["input_ids"]]
    types = [list(x) for x in encoded.get("token_type_ids") or []] if rows.pairs is not None else []
    targets = _targets(rows, labels)
    if labels.task == CLASSIFICATION:
        return Encoded(input_ids=ids, labels=targets, token_type_ids=types)
    return Encoded(input_ids=ids, task=labels.task, scores=targets, token_type_ids=types)


def _encode_words(rows: TaskRows, labels: LabelMap, tokenizer: Any, max_length: int) -> Encoded:
    """A tagger's rows: each word's tag on its first sub-token, IGNORE_INDEX on the rest and on special tokens (as
    transformers' run_ner with label_all_tokens off); words beyond ``max_length`` are cut, as their text would be."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"model.name: {getattr(tokenizer, 'name_or_path', 'the model')}'s tokenizer is not a fast (Rust) one, "
            "which token-classification needs to map sub-tokens to words; use a model with a tokenizer.json"
        )
    encoded = tokenizer(rows.texts, is_split_into_words=True, truncation=True, max_length=max_length)
    ids, token_labels = [], []
    for i, tags in enumerate(_targets(rows, labels)):
        word_ids = encoded.word_ids(i)
        aligned = [IGNORE_INDEX] * len(word_ids)
        for position, word in enumerate(word_ids):
            if word is not None and (position == 0 or word_ids[position - 1] != word):
                aligned[position] = tags[word]
        if all(label == IGNORE_INDEX for label in aligned):
            raise DataError(
                f"data file {rows.path}: line {rows.lines[i]}: no word of {short(' '.join(rows.texts[i]))!r} "
                "tokenises to anything; fix or remove the row"
            )
        ids.append(list(encoded["input_ids"][i]))
        token_labels.append(aligned)
    return Encoded(input_ids=ids, token_labels=token_labels, task=TOKEN_CLASSIFICATION)


def _encode_text(rows: TextRows, tokenizer: Any, max_length: int) -> Encoded:
    """Causal-LM sequences: prompt tokens (with the tokenizer's BOS, if it adds one), then the
    text and an EOS so the model learns where a response ends; cut at ``max_length``."""
    prompts = tokenizer(rows.prompts, return_attention_mask=False)["input_ids"]
    texts = tokenizer(rows.texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids, prompt_lengths, dropped = [], [], []
    for prompt, text, line_no in zip(prompts, texts, rows.lines, strict=True):
        sequence = (list(prompt) + list(text) + eos)[:max_length]
        # Keep only sequences with something to predict after the prompt; the rest is left out, as for chat rows.
        if len(sequence) > max(len(prompt), 1):
            ids.append(sequence)
            prompt_lengths.append(len(prompt))
        else:
            dropped.append(line_no)
    return Encoded(input_ids=ids, prompt_lengths=prompt_lengths, task=CAUSAL_LM, dropped=dropped)


LEFT_OUT = "every token it trains on (the response, the assistant's turns) lies beyond model.max_length ({})"
SHOWN_LINES = 5


def left_out(prepared: Prepared, cfg: DataConfig, max_length: int) -> list[str]:
    """One line per file that had rows left out: how many, why, and the first few line numbers."""
    return [
        f"data file {name}: {len(split.dropped)} of {len(split) + len(split.dropped)} rows left out, as "
        f"{LEFT_OUT.format(max_length)} ({_lines(split.dropped, source)})"
        for name, source, split in _named(prepared, cfg)
        if split.dropped
    ]


def check_dropped(prepared: Prepared, cfg: DataConfig, max_length: int) -> None:
    """Refuse a file that lost every row, or more than ``data.max_dropped_share`` of them, to ``max_length``:
    a few long rows are normal, many mean the length is wrong for this data."""
    for name, source, split in _named(prepared, cfg):
        total = len(split) + len(split.dropped)
        why = f"{LEFT_OUT.format(max_length)} ({_lines(split.dropped, source)})"
        if not len(split):
            raise DataError(
                f"data file {name}: every row ({total}) is left out, as {why}; raise model.max_length or shorten "
                "the prompts and conversations"
            )
        if len(split.dropped) > cfg.max_dropped_share * total:
            raise DataError(
                f"data file {name}: {len(split.dropped)} of {total} rows ({len(split.dropped) / total:.0%}) would be "
                f"left out, more than data.max_dropped_share ({cfg.max_dropped_share:g}), as {why}; raise "
                "model.max_length, shorten those rows, or raise data.max_dropped_share"
            )


def _named(prepared: Prepared, cfg: DataConfig) -> list[tuple[str, Path, Encoded]]:
    """Each split with its name in messages and the file (or dataset split) its row numbers count in."""
    (train, validation), first = names(cfg), Path(cfg.train or cfg.dataset)
    return [
        (train, first, prepared.train),
        (validation, Path(cfg.validation) if cfg.validation else first, prepared.validation),
    ]


def _lines(numbers: list[int], path: Path) -> str:
    """``lines 3, 9`` of a text file, ``rows 3, 9`` of other sources."""
    shown = ", ".join(map(str, numbers[:SHOWN_LINES]))
    more = f" and {len(numbers) - SHOWN_LINES} more" if len(numbers) > SHOWN_LINES else ""
    return f"{unit(path)}{'s' if len(numbers) > 1 else ''} {shown}{more}"


def _cache_key(cfg: DataConfig, tokenizer: Any, max_length: int, task: str) -> str:
    columns = f"{cfg.text_column}|{cfg.label_column}|{cfg.prompt_column}|{cfg.response_column}|{cfg.messages_column}"
    columns += f"|{cfg.text_pair_column}|{cfg.label_separator}"
    columns += "" if cfg.header else "|no header"  # the first row is an example too
    # Which rows each split holds: the dataset's splits, or the share held out of the training rows.
    columns += f"|{cfg.train_split}|{cfg.validation_split}|{cfg.validation_fraction}|{cfg.split_seed}"
    h = hashlib.sha256(f"v{CACHE_VERSION}|{task}|{max_length}|{columns}".encode())
    h.update(digest(cfg).encode())
    h.update(_tokenizer_identity(tokenizer).encode())
    return h.hexdigest()[:24]


def _tokenizer_identity(tokenizer: Any) -> str:
    """The tokenizer's vocabulary and rules, without the truncation/padding settings of its last call that a
    fast tokenizer's serialisation holds too (raw, the key would change once it has tokenised anything)."""
    # The chat template decides which tokens a conversation becomes and which are trained on.
    template = str(getattr(tokenizer, "chat_template", None))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return repr(tokenizer) + template
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    return json.dumps(state, sort_keys=True) + template


def _write_atomic(path: Path, value: Prepared) -> None:
    # Every writer renames a complete private file into place: a reader sees nothing or a whole cache, never a torn one.
    # The rename replaces whatever was planted at ``path`` (a FIFO, a link) instead of writing through it; the new
    # file has the data's mode (the tokens and label names are the data's).
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        regular.check_unmoved(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with regular.create_new(tmp, value.mode if value.mode is not None else 0o600) as f:
            json.dump(_to_json(value), f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot write token cache %s (%s); continuing without it", path, exc)
