"""Chat data for causal LMs: conversations rendered with the tokenizer's chat template, where only the
assistant's turns count in the loss; real templates mark no such span, so :func:`render` finds it by
rendering up to and through each turn (docs/adapters.md, "Chat data")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpsearch.trainer.reading import DataError, Records, at, short
from hpsearch.trainer.task_names import CAUSAL_LM, IGNORE_INDEX
from hpsearch.trainer.tokenised import Encoded

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]


@dataclass(frozen=True)
class ChatRows:
    """Conversations read from a chat file, each with the line it came from (for errors after tokenising)."""

    conversations: list[list[Message]]
    lines: list[int]
    path: Path


def read_chat_rows(path: Path, column: str, records: Records) -> ChatRows:
    """Check every row's message list (no tokenizer needed): said before anything is tokenised."""
    conversations, lines = [], []
    for line_no, record in records:
        if column not in record:
            raise DataError(
                f"data file {path}: {at(path, line_no)} has no column {column!r}; the file's first row holds a "
                f"conversation there, so every row must (columns: {short(', '.join(map(str, record)), 120)})"
            )
        conversations.append(_messages(record[column], f"data file {path}: {at(path, line_no)}: {column!r}"))
        lines.append(line_no)
    return ChatRows(conversations, lines, path)


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f'{where} must be a non-empty list of messages ({{"role": ..., "content": ...}}), got {_json(value)}'
        )
    for i, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f'{where}: message {i} must be an object with "role" and "content", got {_json(message)}')
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {_json(message['role'])}; roles are {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: message {i}: content must be a string, got {_json(message['content'])}")
    if not any(m["role"] == "assistant" for m in value):
        # Only assistant turns are trained on: such a row would contribute nothing but compute.
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train on; add one")
    return [dict(m) for m in value]


def _json(value: Any) -> str:
    return short(json.dumps(value, ensure_ascii=False), 60)


def encode_chat(rows: ChatRows, tokenizer: Any, max_length: int) -> Encoded:
    """Token ids and per-token labels (the id inside assistant turns, IGNORE_INDEX elsewhere), cut at ``max_length``;
    a conversation whose assistant tokens all lie beyond it is left out (its line in ``Encoded.dropped``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data file {rows.path}: {at(rows.path, rows.lines[0])} is chat data, but the tokenizer of "
            f"{getattr(tokenizer, 'name_or_path', 'the model')} has no chat template; use a model folder whose "
            'tokenizer_config.json has "chat_template" (or that holds chat_template.jinja), e.g. an -Instruct model'
        )
    ids, labels, dropped = [], [], []
    for conversation, line_no in zip(rows.conversations, rows.lines, strict=True):
        tokens, token_labels = render(tokenizer, conversation, f"data file {rows.path}: {at(rows.path, line_no)}")
        first = next(i for i, label in enumerate(token_labels) if label != IGNORE_INDEX)
        # Position 0 is never predicted (nothing precedes it), hence first >= 1 to count. Such a row is left out,
        # not refused: real chat sets always hold a few conversations longer than the length chosen
        # (dataset.check_dropped refuses a file that loses more than data.max_dropped_share).
        if max(first, 1) >= max_length:
            dropped.append(line_no)
            continue
        ids.append(tokens[:max_length])
        labels.append(token_labels[:max_length])
    return Encoded(input_ids=ids, token_labels=labels, task=CAUSAL_LM, dropped=dropped)


def render(tokenizer: Any, conversation: list[Message], where: str) -> tuple[list[int], list[int]]:
    """The conversation's tokens and their labels: each token's own id within an assistant turn."""
    text = _template(tokenizer, conversation, False, where)
    ids = _tokens(tokenizer, text)
    labels = [IGNORE_INDEX] * len(ids)
    for k, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, conversation[:k], True, where)
        through = _template(tokenizer, conversation[: k + 1], False, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{where}: the tokenizer's chat template renders the conversation up to message {k + 1} "
                "differently from the start of the whole conversation, so its assistant tokens cannot be found; "
                "use a template that renders each turn after the previous ones (Qwen2.5, Llama 3 and Mistral do)"
            )
        # The longest common token prefix, not len(): tokenising a prefix alone can end in a
        # different token where the full text merges across the boundary; the token that
        # straddles it holds assistant text, so the turn starts there.
        start, end = _common(_tokens(tokenizer, before), ids), _common(_tokens(tokenizer, through), ids)
        end = _without_trailing_space(tokenizer, ids, start, end)
        labels[start:end] = ids[start:end]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(f"{where}: the chat template renders no token for the assistant's turns")
    return ids, labels


def _template(tokenizer: Any, messages: list[Message], generation_prompt: bool, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # a template's raise_exception ("roles must alternate"), or a Jinja error
        raise DataError(f"{where}: the tokenizer's chat template refuses the conversation ({exc})") from None
    return str(text)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    # The template writes its own BOS (Llama 3's <|begin_of_text|>): another must not be added.
    return list(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])


def _common(prefix: list[int], ids: list[int]) -> int:
    pairs = zip(prefix, ids, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(prefix), len(ids)))


def _without_trailing_space(tokenizer: Any, ids: list[int], start: int, end: int) -> int:
    """Drop the newline some templates write after the end-of-turn token (Qwen's ``<|im_end|>\\n``):
    scaffolding, not the reply; generation stops at the end-of-turn token before it."""
    while end - start > 1 and not tokenizer.decode([ids[end - 1]]).strip():
        end -= 1
    return end
