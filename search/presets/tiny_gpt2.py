"""The gpt2-lr preset's model and data: a tiny GPT-2 (``builtin://tiny-gpt2``) built from code and a fixed seed on
first use, no download, from random weights (a trial's loss falls from ~ln(vocabulary)), and short review texts
(``python -m hpsearch.search.presets.tiny_gpt2`` rewrites the shipped files)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpsearch.search.presets import demo_data

log = logging.getLogger(__name__)
NAME = "tiny-gpt2"
EOS = "<|endoftext|>"
PAD = "<pad>"


def texts(n: int, seed: int) -> list[str]:
    return [with_verdict(row) for row in demo_data.generate(n, seed)]


def with_verdict(row: dict[str, str]) -> str:
    """A review sentence ending in its verdict: a model must read the sentence to end it well."""
    return f"{row['text']}. verdict: {row['label']}"


def write_data(folder: Path, n_train: int = 400, n_validation: int = 100) -> None:
    for split, n, seed in (("train", n_train, 11), ("validation", n_validation, 12)):
        with (folder / f"gpt2-lr-{split}.jsonl").open("w") as f:
            for text in texts(n, seed):
                f.write(json.dumps({"text": text}) + "\n")


def ensure_built(root: Path, name: str, builder: Callable[[Path], Path]) -> Path:
    """The built-in model ``name``'s folder under ``root``, built there first if it is not yet (safe to race)."""
    target = root / name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        builder(tmp)
        # Several workers may build at once: the first rename wins, the others drop theirs.
        os.rename(tmp, target)
        log.info("built %s in %s", name, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build(
    folder: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 512, dropout: float = 0.1
) -> Path:
    """Write a randomly initialised GPT-2 (seed 0) and its tokenizer to ``folder``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would clutter the CLI's output

    tokenizer = bpe_tokenizer(texts(2000, seed=99), [EOS], vocab)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bpe_tokenizer(texts: list[str], specials: list[str], vocab: int) -> Any:
    """A byte-level BPE tokenizer trained on ``texts``, with ``specials`` (the first is BOS and EOS) and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[*specials, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no unknown token
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=specials[0], eos_token=specials[0], pad_token=PAD)


if __name__ == "__main__":
    write_data(Path(__file__).parent)
