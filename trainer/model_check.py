"""A model's config, checked before any model is built from it (even an empty one on the meta device, for the memory
plan): a config.json is input, and one with ``hidden_size = 1e12`` or ``num_hidden_layers = 1e9`` would otherwise
end in a traceback, or grow the memory until the process is killed, inside transformers.

Each size must be a positive integer within a range a released model fits with room to spare, the heads must divide
the hidden size, and the parameter count, worked out from these numbers alone (no module built), must stay under a
cap. Refusals are ConfigError: one line, exit 2, for `plan`, `start` and `worker` alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpsearch.trainer.config import ConfigError


@dataclass(frozen=True)
class Size:
    """One size of a config: the names it goes by (transformers' own, then GPT-2's and others'), and its range."""

    names: tuple[str, ...]
    high: int
    why: str  # what the upper bound leaves room for


SIZES = {
    "hidden_size": Size(("hidden_size", "n_embd", "d_model"), 2**17, "the widest released model is 25,600 wide"),
    "num_hidden_layers": Size(("num_hidden_layers", "n_layer", "num_layers"), 2**10, "the deepest has ~200 layers"),
    "num_attention_heads": Size(("num_attention_heads", "n_head", "num_heads"), 2**12, "the most is 128 or so"),
    "vocab_size": Size(("vocab_size",), 2**22, "the largest vocabularies have ~260,000 tokens"),
    "intermediate_size": Size(("intermediate_size", "n_inner", "ffn_dim"), 2**20, "the widest is ~100,000"),
    "max_position_embeddings": Size(("max_position_embeddings", "n_positions"), 2**24, "the longest take 10M"),
    "num_local_experts": Size(("num_local_experts", "num_experts", "n_routed_experts"), 2**10, "the most is 384"),
}
MAX_PARAMETERS = 2 * 10**12
"""About twice the largest open model (1T): the parameter count a config may describe, counted before it is built."""
MAX_BLOCKS = 2**16
"""Layers times experts: every one is built as modules, which cost host memory even without weights."""


def check_config(config: Any, name: str) -> None:
    """Refuse (ConfigError) a config no model can be built from in bounded time and memory; ``name`` is the
    model's folder or id, for the message."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {key: _size(text, key, size, name) for key, size in SIZES.items()}
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    head_dim = getattr(text, "head_dim", None)
    explicit = isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0
    if hidden is not None and heads is not None and hidden % heads and not explicit:
        raise ConfigError(
            f"model.name: {name}'s config.json: hidden_size {hidden} is not a multiple of num_attention_heads "
            f"{heads}; no such model can be built: fix config.json or use another model"
        )
    blocks = (sizes["num_hidden_layers"] or 0) * (sizes["num_local_experts"] or 1)
    if blocks > MAX_BLOCKS:  # each a module object, even on the meta device
        raise ConfigError(
            f"model.name: {name}'s config.json describes {blocks:,} layers x experts, more than {MAX_BLOCKS:,}; "
            "fix config.json or use another model"
        )
    count = parameter_count(sizes)
    if count > MAX_PARAMETERS:
        raise ConfigError(
            f"model.name: {name}'s config.json describes about {count:.3g} parameters, more than hpsearch plans or "
            f"trains ({MAX_PARAMETERS:.0e}); fix config.json or use another model"
        )


def _size(config: Any, key: str, size: Size, name: str) -> int | None:
    """The value of the first of ``size``'s names that the config holds (None where it holds none, or null)."""
    held = vars(config)
    found = next((n for n in size.names if n in held and held[n] is not None), None)
    if found is None:
        return None
    value = held[found]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= size.high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ConfigError(
            f"model.name: {name}'s config.json: {found} = {shown} must be an integer from 1 to {size.high:,} "
            f"({size.why}); fix config.json or use another model"
        )
    return value


def parameter_count(sizes: dict[str, int | None]) -> int:
    """An upper estimate of the parameters a config describes, by arithmetic on its sizes: embeddings and an untied
    head (2 x vocab x hidden), learned positions (positions x hidden), and per layer attention (4 x hidden^2) and a
    gated MLP (3 x hidden x intermediate, 4 x hidden where it names none) for each expert."""
    hidden = sizes.get("hidden_size") or 0
    inner = sizes.get("intermediate_size") or 4 * hidden
    layers, experts = sizes.get("num_hidden_layers") or 0, sizes.get("num_local_experts") or 1
    tables = (2 * (sizes.get("vocab_size") or 0) + (sizes.get("max_position_embeddings") or 0)) * hidden
    return tables + layers * (4 * hidden * hidden + experts * 3 * hidden * inner)
