"""A task's splits (splits.py) tokenised once, with an on-disk cache shared by trials."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpsearch.storage import regular
from hpsearch.trainer import token_cache
from hpsearch.trainer.chat import ChatRows, encode_chat
from hpsearch.trainer.config import DataConfig
from hpsearch.trainer.labels import LabelMap
from hpsearch.trainer.reading import DataError, Rows, TextRows, short, unit
from hpsearch.trainer.sources import digest, files, names
from hpsearch.trainer.splits import Splits, read_splits, targets
from hpsearch.trainer.task_names import CAUSAL_LM, CLASSIFICATION, IGNORE_INDEX, TOKEN_CLASSIFICATION
from hpsearch.trainer.task_rows import TaskRows
from hpsearch.trainer.tokenised import Encoded, Prepared

log = logging.getLogger(__name__)


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
    files' contents, the task, the tokenizer and ``max_length``) and memory-mapped (token_cache.py); ``splits``: as
    ``read_splits`` read them. ``write=False`` reads a cached copy but writes none (a `start` whose other checks may
    still fail: :func:`keep` writes it once the study exists). A file that loses too many rows to ``max_length`` is
    refused (check_dropped), read from the cache or not: the share allowed is no part of the cache's key."""
    if cache_dir is not None and (cache_dir.is_symlink() or not regular.unmoved(cache_dir)):
        # A shared runs folder is input: a link there (or on the way there: an output folder swapped for one) would
        # have the cache written (and read) elsewhere.
        log.warning(
            "not using the token cache %s: it is (or lies behind) a link, and hpsearch writes through none", cache_dir
        )
        cache_dir = None
    mode, key = data_mode(cfg), _cache_key(cfg, tokenizer, max_length, task)
    if cache_dir is None:
        return _private(cfg, tokenizer, max_length, task, splits, key, mode)
    path = token_cache.entry(cache_dir, key)
    cached = _hit(path, key, cfg, max_length)
    if cached is None and not write:
        return _private(cfg, tokenizer, max_length, task, splits, key, mode)
    if cached is None:
        # Several workers starting at once: one tokenises under an exclusive lock, the others wait and map its files.
        with _exclusive(path.with_suffix(".lock")):
            cached = _hit(path, key, cfg, max_length)
            if cached is None:
                try:
                    tmp, cached = _tokenise(cfg, tokenizer, max_length, task, splits, cache_dir, key, mode)
                except OSError as exc:
                    log.warning("cannot write token cache %s (%s); continuing without it", path, exc)
                    return _private(cfg, tokenizer, max_length, task, splits, key, mode)
                if tmp is not None:
                    _publish(tmp, path)
    return dataclasses.replace(cached, mode=mode)


def keep(prepared: Prepared, cfg: DataConfig, tokenizer: Any, max_length: int, cache_dir: Path) -> None:
    """Write what ``prepare(..., write=False)`` tokenised into ``cache_dir``, unless a copy is there already (from
    its mapped rows, a piece at a time: nothing is tokenised again)."""
    if cache_dir.is_symlink() or not regular.unmoved(cache_dir):
        return  # prepare() said so
    key = _cache_key(cfg, tokenizer, max_length, prepared.task)
    path = token_cache.entry(cache_dir, key)
    if os.path.lexists(path):
        return
    pieces = {"train": token_cache.chunks(prepared.train), "validation": token_cache.chunks(prepared.validation)}
    mode = prepared.mode if prepared.mode is not None else 0o600
    with _exclusive(path.with_suffix(".lock")):
        if os.path.lexists(path):
            return
        try:
            tmp, _ = token_cache.build(cache_dir, key, prepared, pieces, mode, token_cache.narrow_ids(tokenizer))
        except OSError as exc:
            log.warning("cannot write token cache %s (%s); continuing without it", path, exc)
            return
        _publish(tmp, path)


def _hit(path: Path, key: str, cfg: DataConfig, max_length: int) -> Prepared | None:
    """The cached entry mapped, checked as freshly tokenised splits are (check_dropped), or None."""
    cached = token_cache.load(path, key)
    if cached is not None:
        log.info("token cache hit: %s", path)
        check_dropped(cached, cfg, max_length)
    return cached


def _publish(tmp: Path, path: Path) -> None:
    try:
        token_cache.publish(tmp, path)
    except OSError as exc:
        regular.remove(tmp)  # the splits stay mapped from the deleted files: this worker goes on without a cache
        log.warning("cannot write token cache %s (%s); continuing without it", path, exc)


def _private(
    cfg: DataConfig, tokenizer: Any, max_length: int, task: str, splits: Splits | None, key: str, mode: int
) -> Prepared:
    """Tokenised into a private temporary folder, mapped, and the folder deleted at once: the mapped files live
    on until the splits are dropped, and nothing is left behind (a `start` that fails writes nothing)."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="hpsearch-tokens-")).resolve()  # no link on the way (macOS: /var)
    except OSError as exc:
        log.warning("cannot make a temporary folder (%s): the tokenised splits are held in memory", exc)
        return _tokenise(cfg, tokenizer, max_length, task, splits, None, key, mode)[1]
    try:
        _, prepared = _tokenise(cfg, tokenizer, max_length, task, splits, folder, key, mode)
    except OSError as exc:  # the temporary disk is full, say: not the data's fault
        log.warning("cannot write the tokenised splits to %s (%s): they are held in memory", folder, exc)
        return _tokenise(cfg, tokenizer, max_length, task, splits, None, key, mode)[1]
    finally:
        regular.remove(folder)
    return prepared


def _tokenise(
    cfg: DataConfig,
    tokenizer: Any,
    max_length: int,
    task: str,
    splits: Splits | None,
    folder: Path | None,
    key: str,
    mode: int,
) -> tuple[Path | None, Prepared]:
    """Tokenise both splits CHUNK_ROWS rows at a time into an unpublished entry in ``folder``: the token ids of a
    big file are never all in Python lists at once. Refused (and removed) when check_dropped refuses it. ``folder``
    None: into Python lists (no disk to write to)."""
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

    def pieces(rows: Any) -> Iterator[Encoded]:
        for piece in _pieces(rows, token_cache.CHUNK_ROWS):
            yield encode(piece)

    shared = Prepared(Encoded([]), Encoded([]), labels, pad_id=int(pad_id or 0), task=task)
    built = {"train": pieces(splits.train), "validation": pieces(splits.validation)}
    if folder is None:
        joined = dataclasses.replace(shared, train=_joined(built["train"]), validation=_joined(built["validation"]))
        check_dropped(joined, cfg, max_length)
        return None, dataclasses.replace(joined, mode=mode)
    tmp, prepared = token_cache.build(folder, key, shared, built, mode, token_cache.narrow_ids(tokenizer))
    try:
        check_dropped(prepared, cfg, max_length)  # before a cache is published for a file that is refused
    except BaseException:
        regular.remove(tmp)
        raise
    return tmp, dataclasses.replace(prepared, mode=mode)


def _joined(pieces: Iterator[Encoded]) -> Encoded:
    """One split from its pieces, as Python lists."""
    fields = ("input_ids", "labels", "prompt_lengths", "token_labels", "scores", "token_type_ids", "dropped")
    lists: dict[str, list[Any]] = {name: [] for name in fields}
    task = CLASSIFICATION
    for piece in pieces:
        task = piece.task
        for name in fields:
            lists[name].extend(getattr(piece, name))
    return Encoded(task=task, **lists)


def _pieces(rows: Any, size: int) -> Iterator[Any]:
    """``rows`` (Rows, TaskRows, TextRows or ChatRows) ``size`` rows at a time: every per-row list field sliced,
    the rest (the path) kept."""
    per_row = [f.name for f in dataclasses.fields(rows) if isinstance(getattr(rows, f.name), list)]
    count = max(len(getattr(rows, name)) for name in per_row)
    per_row = [name for name in per_row if len(getattr(rows, name)) == count]
    for start in range(0, count, size):
        yield dataclasses.replace(rows, **{name: getattr(rows, name)[start : start + size] for name in per_row})


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
    wanted = targets(rows, labels)
    if labels.task == CLASSIFICATION:
        return Encoded(input_ids=ids, labels=wanted, token_type_ids=types)
    return Encoded(input_ids=ids, task=labels.task, scores=wanted, token_type_ids=types)


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
    for i, tags in enumerate(targets(rows, labels)):
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
    h = hashlib.sha256(f"v{token_cache.CACHE_VERSION}|{task}|{max_length}|{columns}".encode())
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
