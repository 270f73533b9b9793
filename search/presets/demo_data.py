"""The bert-lr preset's demo task: short movie-review sentences with their sentiment, from a fixed seed
(``python -m hpsearch.search.presets.demo_data`` rewrites the shipped files). Not trivial: negation flips a phrase
("not good") and in "X, but Y" the clause after "but" decides, so a model must read word order."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = [
    "the movie",
    "this film",
    "the plot",
    "the acting",
    "the soundtrack",
    "the script",
    "the ending",
    "the cast",
    "the director's latest work",
    "the dialogue",
    "the pacing",
    "the cinematography",
    "this sequel",
    "the story",
    "the lead performance",
    "the humor",
]
POSITIVE = [
    "wonderful",
    "moving",
    "brilliant",
    "charming",
    "gripping",
    "delightful",
    "superb",
    "funny",
    "beautiful",
    "clever",
    "engaging",
    "heartfelt",
    "memorable",
    "stunning",
]
NEGATIVE = [
    "dull",
    "boring",
    "clumsy",
    "tedious",
    "predictable",
    "awful",
    "bland",
    "messy",
    "forgettable",
    "lifeless",
    "painful",
    "shallow",
    "confusing",
    "flat",
]
INTENSIFIERS = ["", "", "really ", "truly ", "quite ", "very ", "remarkably ", "utterly "]
VERBS = ["is", "was", "felt", "seemed"]
NEGATED = ["is not", "was not", "never felt", "hardly seemed"]


def _clause(rng: random.Random, positive: bool) -> str:
    subject = rng.choice(SUBJECTS)
    if rng.random() < 0.3:
        # A negated phrase: "not dull" reads positive, "not brilliant" negative.
        adjective = rng.choice(NEGATIVE if positive else POSITIVE)
        return f"{subject} {rng.choice(NEGATED)} {adjective}"
    adjective = rng.choice(POSITIVE if positive else NEGATIVE)
    return f"{subject} {rng.choice(VERBS)} {rng.choice(INTENSIFIERS)}{adjective}"


def example(rng: random.Random) -> dict[str, str]:
    positive = rng.random() < 0.5
    if rng.random() < 0.35:
        text = f"{_clause(rng, not positive)}, but {_clause(rng, positive)}"
    else:
        text = _clause(rng, positive)
    return {"text": text, "label": "positive" if positive else "negative"}


def generate(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [example(rng) for _ in range(n)]


def write(folder: Path, n_train: int = 1200, n_validation: int = 300) -> None:
    for name, n, seed in (("train", n_train, 1), ("validation", n_validation, 2)):
        with (folder / f"bert-lr-{name}.jsonl").open("w") as f:
            for row in generate(n, seed):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    write(Path(__file__).parent)
