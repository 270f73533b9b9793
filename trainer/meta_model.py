"""A model built from its config alone, on the meta device (accelerate's ``init_empty_weights``: shapes and dtypes,
no storage, no weights read): what the memory plan (memory.py) measures, and what a sharded trial's other ranks
start from before rank 0's shards fill them (sharding.py ``shard_from_first``)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from hpsearch.trainer import adapters, precision as prec
from hpsearch.trainer.config import AdapterConfig
from hpsearch.trainer.model import auto_class, from_pretrained


@dataclass(frozen=True)
class Shape:
    """What the activations depend on, read from the config."""

    hidden: int
    layers: int
    vocab: int
    causal: bool
    stored: torch.dtype = torch.float32  # the checkpoint's dtype (its config's)


def meta_model(name: str, task: str, num_labels: int = 2) -> tuple[torch.nn.Module, Shape]:
    """The model of ``name``'s config on the meta device, in the dtype from_pretrained would load it in."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, name)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    causal = task == "causal-lm"
    if not causal:
        config.num_labels = num_labels
    auto = auto_class(task)  # a token classifier's head is as small as a sequence classifier's
    with init_empty_weights():
        # sdpa, as model.py loads it: a sharded trial's empty ranks compute exactly as its first one.
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        try:
            model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except (ValueError, ImportError):  # an architecture without an SDPA kernel
            model = auto.from_config(config, dtype=dtype)
    # As from_pretrained does: a tied head is the embedding, not a second copy. Outside the context, whose
    # parameter hook would make the tied one a new meta parameter again.
    model.tie_weights()
    text: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0))
    layers = int(getattr(text, "num_hidden_layers", 0) or getattr(text, "n_layer", 0))
    return model, Shape(hidden, layers, int(getattr(text, "vocab_size", 0)), causal, prec.stored_dtype(config))


def with_adapter(model: torch.nn.Module, adapter: AdapterConfig, task: str) -> torch.nn.Module:
    """``model`` (on the meta device) with ``adapter`` attached, as a trial would have it."""
    from accelerate import init_empty_weights

    quiet = logging.getLogger(adapters.__name__)
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # its "N trainable parameters" line is a trial's news, not a plan's
    try:
        with init_empty_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's and transformers' notes on the architecture, said at each trial
            return adapters.attach(model, replace(adapter), task, seed=0)
    finally:
        quiet.setLevel(level)


def empty_model(name: str, labels: Any, adapter: Any) -> torch.nn.Module:
    """A sharded trial's model on a rank other than the first: built from the config on the meta device (no weights
    read, no host copy), with the trial's adapter; sharding.py ``shard_from_first`` fills its shards from rank 0's
    model."""
    task = "causal-lm" if labels is None else labels.task
    model, _ = meta_model(name, task, labels.num_labels if labels is not None else 2)
    if labels is not None:
        config: Any = model.config
        config.id2label = dict(labels.id2label())
        config.label2id = {v: k for k, v in config.id2label.items()}
        if labels.task in ("regression", "multi-label"):  # as load_model sets it on the first rank's model
            config.problem_type = labels.problem_type
    if adapter is not None and adapter.enabled:
        model = with_adapter(model, adapter, task)
    return model
