"""LoRA adapters (peft) on a frozen base: attach one per trial, take it off after, merge for export (docs/adapters.md).

peft is imported lazily: a full fine-tune never loads it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from hpsearch.trainer.config import AdapterConfig, ConfigError, ModelConfig
from hpsearch.trainer.dropout import MaskDropout
from hpsearch.trainer.model import NO_REMOTE_CODE, auto_class, from_pretrained
from hpsearch.trainer.task_names import CAUSAL_LM, TOKEN_CLASSIFICATION

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
"""What peft's save_pretrained writes beside adapter_model.safetensors: marks an adapter folder."""
PEFT_TASK_TYPES = {CAUSAL_LM: "CAUSAL_LM", TOKEN_CLASSIFICATION: "TOKEN_CLS"}
"""peft's task_type of each task (the sequence tasks: SEQ_CLS): which head it trains in full and saves, and which
AutoPeftModel class loads the adapter."""


def is_adapter(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def attach(base: torch.nn.Module, cfg: AdapterConfig, task: str, seed: int) -> torch.nn.Module:
    """A freshly seeded LoRA adapter on ``base`` (changed in place: its linear layers are
    wrapped, its own weights frozen). For a classifier, peft's SEQ_CLS task (TOKEN_CLS for a tagger) puts the head
    in ``modules_to_save``: a trainable copy of it, trained in full and saved with the adapter."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type=PEFT_TASK_TYPES.get(task, "SEQ_CLS"),
        exclude_modules=_token_head(base, cfg, task),
    )
    # LoRA's A matrices are drawn from torch's global generator (B starts at zero): the seed
    # makes a trial's adapter the same wherever and whenever it runs.
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    for module in model.modules():  # peft's nn.Dropout in every LoRA layer -> MaskDropout, same p
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for name, drop in drops.items():
                if isinstance(drop, torch.nn.Dropout):
                    drops[name] = MaskDropout(drop.p)
    log.info("LoRA r=%d alpha=%g: %d trainable parameters", cfg.r, cfg.alpha, trainable_parameters(model))
    return model


def _token_head(base: torch.nn.Module, cfg: AdapterConfig, task: str) -> list[str] | None:
    """A tagger's head, kept out of "all-linear": peft leaves a SEQ_CLS head out of it itself, not a TOKEN_CLS one,
    and then refuses to train in full (modules_to_save) a head it has given an adapter."""
    if task != TOKEN_CLASSIFICATION or cfg.target_modules != "all-linear":
        return None
    return [name for name in ("classifier", "score") if isinstance(getattr(base, name, None), torch.nn.Module)] or None


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Take the adapter off ``model`` and return the base as it was loaded: unmerged, and with
    its own head back (peft's unload would leave the trained copy of a modules_to_save head)."""
    from peft.utils.other import ModulesToSaveWrapper

    pretrained: Any = model
    inner = pretrained.base_model.model
    originals = [(name, m.original_module) for name, m in inner.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    if getattr(inner, "_require_grads_hook", None) is not None:
        inner.disable_input_require_grads()
    if getattr(inner, "supports_gradient_checkpointing", False):
        # A no-op when it was off. transformers 5 renamed it, and warns under the old name.
        off = getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable
        off()
    base: Any = pretrained.unload()
    for name, original in originals:
        parent_name, _, attr = name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, attr, original)
    if not getattr(base, "is_quantized", False):
        # Frozen by get_peft_model: a later full fine-tune (adapter.method searched) copies this base. A quantized
        # one stays frozen (its integer weights cannot take a gradient; the spec allows it only with method = "lora").
        base.requires_grad_(True)
    return base


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The resumable part of an adapter model: what it trains (adapter and head), not the base."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`trainable_state` saved; every trainable tensor must be there."""
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != expected:
        missing = sorted(expected - set(state))[:3]
        raise ValueError(f"the resumable state is not this adapter's (missing {missing})")
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"the resumable state has unknown tensors {result.unexpected_keys[:3]}")


def load_saved(folder: Path, num_labels: int | None = None) -> torch.nn.Module:
    """The adapter checkpoint in ``folder`` on its base, as a user loads it (AutoPeftModel*).
    ``num_labels``: a classifier's label count, where it differs from the base's config (the
    base is loaded from its own folder, whose head has the base's count)."""
    from peft import (
        AutoPeftModelForCausalLM,
        AutoPeftModelForSequenceClassification,
        AutoPeftModelForTokenClassification,
    )

    task = json.loads((folder / ADAPTER_CONFIG).read_text()).get("task_type")
    if task == "CAUSAL_LM":
        return AutoPeftModelForCausalLM.from_pretrained(str(folder), **NO_REMOTE_CODE)
    kwargs: dict[str, Any] = {"num_labels": num_labels, "ignore_mismatched_sizes": True} if num_labels else {}
    auto: Any = AutoPeftModelForTokenClassification if task == "TOKEN_CLS" else AutoPeftModelForSequenceClassification
    return auto.from_pretrained(str(folder), **kwargs, **NO_REMOTE_CODE)


def merge(
    source: Path, target: Path, tokenizer: Any, id2label: dict[int, str] | None, problem_type: str | None = None
) -> None:
    """The base with the adapter of ``source`` merged into its weights, saved to ``target``:
    loadable with plain ``from_pretrained``, no peft needed; ``problem_type``: the task's, for config.json (the
    adapter's base config has its own)."""
    loaded: Any = load_saved(source, len(id2label) if id2label else None)
    merged: Any = loaded.merge_and_unload()
    if id2label:
        merged.config.id2label = dict(id2label)
        merged.config.label2id = {v: k for k, v in id2label.items()}
    if problem_type:
        merged.config.problem_type = problem_type
    merged.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def quantization_config(model: ModelConfig) -> Any:
    """QLoRA's loading of the frozen base (Dettmers et al. 2023): 4-bit NormalFloat with double
    quantization and bf16 compute, or LLM.int8(). CUDA only; None without quantization."""
    if model.quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if model.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def check_quantization(model: ModelConfig, device_kinds: list[str]) -> None:
    """A quantized base needs bitsandbytes on CUDA: said once at ``start``, not by each trial."""
    if model.quantization == "none":
        return
    if any(kind != "cuda" for kind in device_kinds) or not torch.cuda.is_available():
        raise ConfigError(
            f"model.quantization: {model.quantization!r} needs CUDA GPUs (bitsandbytes), and this run has "
            'CPU devices or no CUDA; use --devices cuda:..., or quantization = "none"'
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"model.quantization: {model.quantization!r} needs bitsandbytes; pip install bitsandbytes"
        ) from None


def check_targets(model: ModelConfig, adapter: AdapterConfig) -> None:
    """Every name in ``adapter.target_modules`` must name layers of the model that LoRA can adapt (peft's rule: the
    module's name or its last dotted parts; every module it matches must be of a kind peft wraps), checked on an
    empty (meta-device) copy built from the config alone: no weights are read, whatever the model's size."""
    if not adapter.enabled or isinstance(adapter.target_modules, str):
        return
    from transformers import AutoConfig

    auto = auto_class(model.task)
    with torch.device("meta"):
        empty = auto.from_config(from_pretrained(AutoConfig, model.name))
    modules = [(n, m) for n, m in empty.named_modules() if n]
    linear = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, m in modules if _is_linear(m)}))
    for target in adapter.target_modules:
        matched = [(n, m) for n, m in modules if n == target or n.endswith("." + target)]
        if not matched:
            raise ConfigError(
                f"adapter.target_modules: {target!r} names no layer of {model.name}; its linear layers are "
                f'{linear} (or use "all-linear")'
            )
        # peft fails every trial on the first matched module it cannot wrap (a LayerNorm, a whole attention block).
        refused = next(((n, m) for n, m in matched if not _adaptable(m)), None)
        if refused is not None:
            raise ConfigError(
                f"adapter.target_modules: {target!r} names {refused[0]}, a {type(refused[1]).__name__}, which LoRA "
                f'cannot adapt; name linear layers: {linear} (or use "all-linear")'
            )


LORA_LAYERS = (
    torch.nn.Linear,
    torch.nn.Embedding,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.MultiheadAttention,
)
"""The layer kinds peft's LoRA wraps (with transformers' Conv1D): any other target fails in get_peft_model."""


def _adaptable(module: torch.nn.Module) -> bool:
    return isinstance(module, LORA_LAYERS) or _is_linear(module)


def _is_linear(module: torch.nn.Module) -> bool:
    # GPT-2's layers are transformers' Conv1D, a linear layer with its weight transposed.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
