"""CoNLL files for token classification: one token and its tag a line (the tag last: CoNLL-2003's
``EU NNP B-NP B-ORG`` reads as token EU, tag B-ORG), blank lines between sentences, ``-DOCSTART-`` lines skipped."""

from __future__ import annotations

from pathlib import Path

from hpsearch.storage import regular
from hpsearch.trainer.reading import DataError

SUFFIX = ".conll"
DOCUMENT_START = "-DOCSTART-"


def read_conll(path: Path) -> tuple[list[list[str]], list[list[str]], list[int]]:
    """Each sentence's words and tags, and the line it starts at; a DataError naming the line otherwise."""
    if not path.is_file():
        raise DataError(f"data file {path} does not exist or is not a file; check the path in the spec's [data] table")
    try:
        # Opened without blocking and checked to be a regular file, as every data file (trainer/reading.py).
        with regular.open_file(path, "r", follow=True, encoding="utf-8-sig") as f:
            raw = f.read()
    except regular.NotRegularFile as exc:
        raise DataError(f"data file {exc}; point [data] at a .conll file") from None
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path} is not UTF-8 (bad byte at offset {exc.start}); re-save it as UTF-8"
        ) from None
    words: list[list[str]] = []
    tags: list[list[str]] = []
    starts: list[int] = []
    sentence: tuple[list[str], list[str]] = ([], [])
    for line_no, line in enumerate(raw.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0] == DOCUMENT_START:
            sentence = ([], [])  # the next token starts a sentence
            continue
        if len(fields) < 2:
            raise DataError(
                f"data file {path}: line {line_no} has one field ({fields[0]!r}); a CoNLL line is a token and its "
                "tag (the last field), separated by a space or tab; add the tag or remove the line"
            )
        if not sentence[0]:
            sentence = ([], [])
            words.append(sentence[0])
            tags.append(sentence[1])
            starts.append(line_no)
        sentence[0].append(fields[0])
        sentence[1].append(fields[-1])
    if not words:
        raise DataError(f"data file {path} has no sentences; it needs lines of a token and its tag")
    return words, tags, starts


def read_records(path: Path, text_column: object, label_column: object) -> list[tuple[int, dict[object, object]]]:
    """The file's sentences as rows, one a sentence keyed by the spec's columns (its words under ``text_column``, its
    tags under ``label_column``) at the line it starts on: a CoNLL file is then one more source of rows, so
    data.validation_fraction and the row checks apply to it as to any other (trainer/sources.py)."""
    words, tags, starts = read_conll(path)
    return [(start, {text_column: w, label_column: t}) for w, t, start in zip(words, tags, starts, strict=True)]
