"""The lora-chat preset's model and data: a tiny Llama with a ChatML chat template (``builtin://tiny-llama-chat``,
built and briefly pre-trained on first use: see docs/presets.md, "lora-chat: LoRA on chat data"), and review
conversations (``python -m hpsearch.search.presets.tiny_llama_chat`` rewrites the shipped files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpsearch.search.presets import demo_data, tiny_gpt2

NAME = "tiny-llama-chat"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen2.5's template renders it (without Qwen's tools and default system prompt)."""


def conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": row["text"]}, {"role": "assistant", "content": f"verdict: {row['label']}"}]
        for row in demo_data.generate(n, seed)
    ]


def write_data(folder: Path, n_train: int = 400, n_validation: int = 100) -> None:
    for split, n, seed in (("train", n_train, 21), ("validation", n_validation, 22)):
        with (folder / f"lora-chat-{split}.jsonl").open("w") as f:
            for messages in conversations(n, seed):
                f.write(json.dumps({"messages": messages}) + "\n")


def chat_tokenizer(texts: list[str], specials: list[str], *, vocab: int = 512, template: str = CHAT_TEMPLATE) -> Any:
    """tiny_gpt2's BPE tokenizer trained on ``texts``, with ``specials`` (the first is EOS) and a chat template."""
    tokenizer = tiny_gpt2.bpe_tokenizer(texts, specials, vocab)
    tokenizer.chat_template = template
    return tokenizer


def build(folder: Path, *, layers: int = 2, hidden: int = 64, pretrain_steps: int = 300) -> Path:
    """Write a tiny Llama (seed 0), pre-trained for ``pretrain_steps`` steps, and its tokenizer to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows = demo_data.generate(2000, seed=99)
    # Plain reviews ending in their verdict, and chat turns of another task (say the review's
    # first two words): the base knows the words and the format, and the adapter must join them.
    texts = [tiny_gpt2.with_verdict(row) for row in rows[:1000]]
    tokenizer = chat_tokenizer([*texts, "user assistant system"], [tiny_gpt2.EOS, IM_START, IM_END])
    for row in rows[1000:]:
        turns = [{"role": "user", "content": row["text"]}, {"role": "assistant", "content": row["text"][:12]}]
        texts.append(tokenizer.apply_chat_template(turns, tokenize=False))
    # The chat-tuned models' convention: generation stops at the end of the assistant's turn.
    tokenizer.eos_token = IM_END
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    _pretrain(model, tokenizer, texts, pretrain_steps)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _pretrain(model: Any, tokenizer: Any, texts: list[str], steps: int, batch: int = 32) -> None:
    """Next-token prediction on ``texts``, seeded; one thread so that any host builds the same weights."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            rows = [encoded[i] for i in torch.randint(len(encoded), (batch,), generator=generator).tolist()]
            width = max(map(len, rows))
            ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
            labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
            loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    write_data(Path(__file__).parent)
