"""Data of the tasks beyond classification, derived from the demo reviews (search/presets/demo_data.py), which a
tiny BERT's vocabulary covers: a number, a label set, a tag a word, or a sentence pair each row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpsearch.search.presets import demo_data

POSITIVE, NEGATIVE = set(demo_data.POSITIVE), set(demo_data.NEGATIVE)


def regression_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """A score per review: 4 for positive, 1 for negative, plus a tenth for each intensifier (really, very...)."""
    intensifiers = {w.strip() for w in demo_data.INTENSIFIERS if w}
    rows = []
    for row in demo_data.generate(n, seed):
        bonus = sum(word in intensifiers for word in row["text"].split()) / 10
        rows.append({"text": row["text"], "score": (4.0 if row["label"] == "positive" else 1.0) + bonus})
    return rows


def pair_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Two reviews a row; ``label``: "same" where their sentiment agrees, else "different"; ``score``: how many of
    the two are positive (0-2), a pair regression."""
    first, second = demo_data.generate(n, seed), demo_data.generate(n, seed + 1000)
    return [
        {
            "text": a["text"],
            "text2": b["text"],
            "label": "same" if a["label"] == b["label"] else "different",
            "score": float((a["label"] == "positive") + (b["label"] == "positive")),
        }
        for a, b in zip(first, second, strict=True)
    ]


def multi_label_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Which kinds of adjective a review uses: a subset of {praise, criticism}, from its words (negation aside),
    plus "contrast" where it has a "but"; some rows have none."""
    rows = []
    for row in demo_data.generate(n, seed):
        words = set(row["text"].replace(",", "").split())
        labels = [name for name, hit in (("praise", words & POSITIVE), ("criticism", words & NEGATIVE)) if hit]
        labels += ["contrast"] if "but" in words else []
        rows.append({"text": row["text"], "labels": labels})
    return rows


def token_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Each word tagged: B-POS / B-NEG on the demo lexicon's adjectives, B-SUBJ I-SUBJ... on the first two words of
    a clause's subject ("the plot"), O elsewhere."""
    rows = []
    for row in demo_data.generate(n, seed):
        words = row["text"].replace(",", " ,").split()
        tags = ["B-POS" if w in POSITIVE else "B-NEG" if w in NEGATIVE else "O" for w in words]
        for i, word in enumerate(words):
            if word in ("the", "this") and (i == 0 or words[i - 1] in (",", "but")):
                tags[i], tags[i + 1] = "B-SUBJ", "I-SUBJ"
        rows.append({"tokens": words, "tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_conll(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``token_rows`` as a CoNLL file: a token and its tag a line, a blank line after each sentence."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["-DOCSTART- -X- O", ""]
    for row in rows:
        lines += [f"{word}\t{tag}" for word, tag in zip(row["tokens"], row["tags"], strict=True)] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path
