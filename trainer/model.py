"""Loading a pre-trained model once per process and handing each trial a fresh copy."""

from __future__ import annotations

import gc
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.nn.parallel import DistributedDataParallel

from hpsearch.storage import regular
from hpsearch.trainer import model_check, precision as prec
from hpsearch.trainer.config import AdapterConfig, ConfigError
from hpsearch.trainer.errors import ModelError
from hpsearch.trainer.labels import PROBLEM_TYPES
from hpsearch.trainer.task_names import CAUSAL_LM, CLASSIFICATION, MULTI_LABEL, REGRESSION, TOKEN_CLASSIFICATION


def _quiet_transformers() -> None:
    import transformers

    # Load reports ("classifier.weight MISSING") are expected for a new head; keep logs clean.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


NO_REMOTE_CODE: dict[str, Any] = {"trust_remote_code": False}
"""Passed to every ``from_pretrained``: a model folder (or a hub id a stored spec names) may carry Python that
transformers would otherwise offer to run, on an interactive terminal after one "y". hpsearch never runs it."""
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")


MAX_CONFIG_BYTES = 64 * 2**20
"""A config.json or tokenizer_config.json larger than this is no model's (the largest, with a chat template, are
a few hundred kB)."""


def refuse_custom_code(name: str) -> None:
    """A local model folder whose config asks for its own code (``auto_map``) is refused in one line, before any
    load: with ``trust_remote_code=False`` transformers would refuse it too, in a longer message. So is a folder
    holding a FIFO, device or socket, which any load would hang on (:func:`refuse_special_files`)."""
    folder = _local_path(name)
    if folder is None:
        return
    refuse_special_files(folder, name)
    for file in CUSTOM_CODE_FILES:
        try:
            config = json.loads(regular.read_text(folder / file, MAX_CONFIG_BYTES, follow=True))
        except (OSError, ValueError):
            continue  # absent or unreadable: the load that needs it says so
        if isinstance(config, dict) and "auto_map" in config:
            raise ModelError(
                f"model.name: folder {name} needs its own Python code ({file} has an auto_map), which hpsearch "
                "never runs; use a model whose architecture transformers ships"
            )


def refuse_special_files(folder: Path, name: str) -> None:
    """Every entry of a model folder is a file or a folder (links followed: a hub cache's snapshot is links into
    its blobs): a FIFO as its config.json would hang transformers' read, and `start` or `plan` with it, for good."""
    if not folder.is_dir():
        return
    for entry in os.scandir(folder):
        try:
            mode = entry.stat().st_mode  # follows a link, as transformers' open does
        except OSError:
            continue  # a dangling link: the load that needs it says so
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ModelError(
                f"model.name: folder {name}: {entry.name} is {regular.kind(mode)}, not a file; a model folder holds "
                "only files and folders: replace it with the real file"
            )


def _local_path(name: str) -> Path | None:
    """``name`` as an existing local path, or None (a hub id)."""
    try:
        path = Path(name).expanduser()
        return path if path.exists() else None
    except (OSError, RuntimeError):  # a name too long for a path, ~user of nobody: no local path
        return None


def check_reachable(name: str, timeout_s: float = 5.0) -> None:
    """A hub id that is not in the local cache needs the hub: say at once when it cannot be
    reached (a cloud instance without access, a mistyped folder that looks like an id), instead
    of after huggingface_hub's retries (half a minute or more of warnings)."""
    if _local_path(name) is not None or os.environ.get("HF_HUB_OFFLINE", "").strip() in ("1", "true", "True"):
        return  # a local folder; or offline mode, where transformers answers at once
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # not a valid hub id (a missing absolute path): loading fails at once, no network
        return
    endpoint = os.environ.get("HF_ENDPOINT", "").strip() or "https://huggingface.co"
    parts = urlsplit(endpoint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
    except (OSError, ValueError):
        raise ModelError(f"{_explain(name, None)} (cannot reach {endpoint}; set HF_ENDPOINT for a mirror)") from None


def from_pretrained(auto: Any, name: str) -> Any:
    """``auto.from_pretrained(name)`` (AutoTokenizer, AutoConfig) as every load of ours: quiet, running no code of
    the folder's, and a failure said in one line."""
    from transformers import PretrainedConfig

    _quiet_transformers()
    refuse_custom_code(name)
    try:
        loaded = auto.from_pretrained(name, **NO_REMOTE_CODE)
    except Exception as exc:  # a broken tokenizer.json raises KeyError, TypeError, ...: all the folder's fault
        raise ModelError(_explain(name, exc)) from None
    if isinstance(loaded, PretrainedConfig):
        # Every config hpsearch reads is checked as it is read, before anything is built from it: check_model's
        # (start, worker) and the memory plan's meta model (memory.py meta_model: plan, start, worker).
        model_check.check_config(loaded, name)
    return loaded


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer, name)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "tokenizer.model",
    "sentencepiece.bpe.model",
)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model(name: str, max_length: int) -> None:
    """What every trial's model load needs, checked without reading the weights: a config
    transformers knows, room for ``max_length`` positions and, for a local folder, a weights
    file. Otherwise every trial would fail on it in turn. The config's sizes are checked as it is read
    (:func:`from_pretrained`, trainer/model_check.py)."""
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig, name)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and max_length > positions:
        raise ConfigError(
            f"model.max_length: {max_length} is more than the model's {positions} positions; set it <= {positions}"
        )
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return
    if not any((folder / f).exists() for f in WEIGHT_FILES):
        raise ModelError(
            f"model.name: folder {name} has no weights (model.safetensors or pytorch_model.bin); "
            "point it at a folder written by save_pretrained"
        )
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        # transformers 5 then builds a tokenizer of five special tokens: every text becomes [UNK].
        raise ModelError(
            f"model.name: folder {name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
            "save the model's tokenizer there too: tokenizer.save_pretrained(folder)"
        )
    check_weights(folder, f"model.name: folder {name}")


def check_weights(folder: Path, where: str) -> None:
    """A safetensors file whose header does not parse (a download or copy cut short) fails
    every load; only the header is read, so this is cheap for any model size."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as exc:
            raise ModelError(
                f"{where}: {path.name} is damaged ({str(exc).splitlines()[0]}); download or save it again"
            ) from None


def _explain(name: str, exc: BaseException | None) -> str:
    if "trust_remote_code" in str(exc):
        return (
            f"model.name: {name} needs its own Python code (trust_remote_code), which hpsearch never runs; "
            "use a model whose architecture transformers ships"
        )
    if _local_path(name) is not None:
        return (
            f"model.name: {name} is a folder but not a loadable model/tokenizer "
            f"({str(exc).splitlines()[0]}); it needs config.json, weights and tokenizer files"
        )
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]:
        return f"model.name: folder {name} does not exist; fix the path"
    return (
        f"model.name: cannot load {name!r}: not a local folder, and the hub is unreachable or "
        "has no such model; download it first (huggingface-cli download) and point at the folder"
    )


class PretrainedCache:
    """Hands each trial a pristine pre-trained model; keeps an adapter trials' frozen base in host memory.

    A full fine-tune gets the model read from its checkpoint again, with a classifier's head freshly and
    deterministically drawn (as ``from_pretrained`` would). Nothing of it is kept between trials: transformers maps a
    safetensors file into memory, so a read costs ~0.1 s for MiniLM (less than a deep copy of a cached model) and
    its weights are the page cache's until training writes them; a cached pristine copy would be a second model in
    the trial's memory (issue 60: 87 MB for MiniLM, 420 MB for BERT-base in fp32). An adapter trial gets no copy:
    a seeded adapter goes onto the one frozen base and :meth:`release` takes it off after the trial, so memory holds
    one base however many trials run (what makes a 7B model on one GPU possible at all). A sharded adapter trial
    (``private``) takes that base itself out of the cache: its weights turn into shards.
    """

    def __init__(self, quantization: Any = None) -> None:
        self._models: dict[tuple[str, str, int, torch.dtype], torch.nn.Module] = {}
        self._stored: dict[str, torch.dtype] = {}
        self.quantization = quantization
        """A transformers BitsAndBytesConfig for the base (QLoRA), or None."""

    def _base(self, name: str, num_labels: int, dtype: torch.dtype, task: str | None = None) -> torch.nn.Module:
        """An adapter trials' shared frozen base, read from disk on first use only (``task``: as :func:`load_model`
        reads it)."""
        task = task or default_task(num_labels)
        key = (name, task, num_labels, dtype)
        if key not in self._models:
            self._models[key] = load_model(name, num_labels, self.quantization, dtype, task=task)
        return self._models[key]

    def _own(self, name: str, num_labels: int, dtype: torch.dtype, task: str) -> torch.nn.Module:
        """A pristine model for a trial to change: the cached base taken out of the cache where there is one (the
        next adapter trial reads it from disk again: the cost of holding one copy), else read from disk."""
        taken = self._models.pop((name, task, num_labels, dtype), None)
        return taken if taken is not None else load_model(name, num_labels, self.quantization, dtype, task=task)

    def fresh(
        self,
        name: str,
        num_labels: int,
        id2label: dict[int, str],
        seed: int,
        *,
        precision: str = "auto",
        task: str = CLASSIFICATION,
    ) -> torch.nn.Module:
        model = self._own(name, num_labels, prec.load_dtype(precision, adapter=False), task)
        _new_head(model, id2label, seed)
        return model

    def trial_model(
        self,
        name: str,
        labels: Any,
        seed: int,
        adapter: AdapterConfig | None = None,
        *,
        private: bool = False,
        precision: str = "auto",
    ) -> torch.nn.Module:
        """A fresh model for one trial: the model of ``labels``' task (a LabelMap: a sequence or token classifier
        with its labels), or a causal LM when there are none; with an enabled ``adapter``, that adapter on the
        shared base (hand it back with :meth:`release`). ``private`` (an adapter trial's): on the base taken out of
        the cache (``_own``): a sharded trial replaces the base's weights by its shards, which no later trial could
        use; a full fine-tune's model is its own anyway. ``precision`` (the spec's ``train.precision``) decides the
        dtype it is loaded in (trainer/precision.py)."""
        # What the previous trial held (its model, gradients and optimizer moments) sits in reference cycles (the
        # loop and its reporter's callbacks point at each other) that only the cyclic collector frees, at a time of
        # its own choosing: collect them before this trial allocates, or the worker holds two trials' tensors at once
        # (issue 60: +260 MB for MiniLM, what training held).
        gc.collect()
        num_labels = labels.num_labels if labels is not None else 0
        task = labels.task if labels is not None else CAUSAL_LM
        if adapter is not None and adapter.enabled:
            from hpsearch.trainer import adapters

            dtype = prec.load_dtype(precision, adapter=True, stored=self.stored(name))
            base = self._own(name, num_labels, dtype, task) if private else self._base(name, num_labels, dtype, task)
            if labels is not None:
                _new_head(base, labels.id2label(), seed)  # peft's trainable head is a copy of this one
            model = adapters.attach(base, adapter, task, seed)
            model.hpsearch_private = private  # release() leaves a private copy alone
            model.hpsearch_stored = base.hpsearch_stored
            return model
        if labels is None:
            return self.fresh_causal_lm(name, precision=precision)
        return self.fresh(name, num_labels, labels.id2label(), seed, precision=precision, task=task)

    def stored(self, name: str) -> torch.dtype:
        """The dtype ``name``'s checkpoint is stored in (its config's), read once per model."""
        if name not in self._stored:
            from transformers import AutoConfig

            self._stored[name] = prec.stored_dtype(from_pretrained(AutoConfig, name))
        return self._stored[name]

    def release(self, model: torch.nn.Module) -> None:
        """After a trial: take an adapter off the shared base (a full fine-tune's copy is just dropped)."""
        from hpsearch.trainer import adapters

        if adapters.is_adapter(model) and not getattr(model, "hpsearch_private", False):
            adapters.detach(model)

    def fresh_causal_lm(self, name: str, *, precision: str = "auto") -> torch.nn.Module:
        return self._own(name, 0, prec.load_dtype(precision, adapter=False), CAUSAL_LM)


def default_task(num_labels: int) -> str:
    """The task of a model asked for by its label count alone: a causal LM without labels, else a classifier."""
    return CAUSAL_LM if num_labels == 0 else CLASSIFICATION


def auto_class(task: str) -> Any:
    """transformers' Auto class of ``task``'s model (what a user loads a best checkpoint with)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    classes = {CAUSAL_LM: AutoModelForCausalLM, TOKEN_CLASSIFICATION: AutoModelForTokenClassification}
    return classes.get(task, AutoModelForSequenceClassification)


def load_model(
    name: str,
    num_labels: int,
    quantization: Any = None,
    dtype: torch.dtype = torch.float32,
    *,
    task: str | None = None,
) -> torch.nn.Module:
    """``task``'s model (by default a sequence classifier with ``num_labels`` labels, or a causal LM when
    ``num_labels`` is 0), its weights in ``dtype`` whatever its config says (trainer/precision.py decides it); with
    ``quantization`` (a BitsAndBytesConfig), quantized on the current CUDA device for QLoRA. The dtype the
    checkpoint is stored in rides along as ``model.hpsearch_stored``: the best model is saved in it."""
    from transformers import AutoConfig

    _quiet_transformers()
    task = task or default_task(num_labels)
    stored = prec.stored_dtype(from_pretrained(AutoConfig, name))
    auto = auto_class(task)
    # A classifier checkpoint with another label count is a fine start: its head is replaced
    # (and re-initialised per trial) anyway.
    kwargs: dict[str, Any] = {"num_labels": num_labels, "ignore_mismatched_sizes": True} if num_labels else {}
    if task in (REGRESSION, MULTI_LABEL):
        # Saved in config.json: a plain from_pretrained of the best model then computes the task's own loss.
        kwargs["problem_type"] = PROBLEM_TYPES[task]
    kwargs.update(NO_REMOTE_CODE)
    refuse_custom_code(name)
    if quantization is not None:
        # bitsandbytes places the quantized weights itself, on this worker's one visible GPU; no
        # dtype: prepare_model_for_kbit_training below upcasts the unquantized layers to fp32 anyway.
        kwargs.update(quantization_config=quantization, device_map={"": 0})
    else:
        # Explicit, never the config's: transformers 5 would otherwise load a bf16 config's weights in bf16.
        kwargs.update(dtype_kwarg(dtype))
    try:
        try:
            model = auto.from_pretrained(name, attn_implementation="sdpa", **kwargs)
        except (OSError, ValueError) as exc:
            if "sdpa" not in str(exc).lower():
                raise
            # Architectures without an SDPA kernel fall back to their default attention.
            model = auto.from_pretrained(name, **kwargs)
        if quantization is not None:
            from peft import prepare_model_for_kbit_training

            # Freezes the base and upcasts its non-quantized layers for stable training.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    except (OSError, ValueError) as exc:
        raise ModelError(_explain(name, exc)) from None
    model.hpsearch_stored = stored
    return model


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant: works under DDP)."""
    pretrained: Any = model
    if hasattr(pretrained, "peft_config"):
        # The frozen embeddings' output needs no gradient, and a checkpointed layer whose input
        # needs none would give its adapters none either: make the input require one.
        pretrained.enable_input_require_grads()
    if hasattr(pretrained, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        pretrained.activation_checkpointing_enable({"use_reentrant": False})
    else:
        pretrained.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _new_head(model: torch.nn.Module, id2label: dict[int, str], seed: int) -> None:
    """Name the labels and re-draw the classifier head's weights from ``seed`` as transformers does."""
    config: Any = model.config
    config.id2label = dict(id2label)
    config.label2id = {v: k for k, v in id2label.items()}
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in _head_modules(model):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)  # cast to its dtype
            if module.bias is not None:
                module.bias.zero_()


def _head_modules(model: torch.nn.Module) -> list[torch.nn.Linear]:
    for attr in ("classifier", "score", "classification_head"):
        head = getattr(model, attr, None)
        if isinstance(head, torch.nn.Module):
            return [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    return []


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model under torch.compile / DDP wrappers, in either order (what gets saved)."""
    inner: Any = model
    while isinstance(inner, DistributedDataParallel) or hasattr(inner, "_orig_mod"):
        inner = inner.module if isinstance(inner, DistributedDataParallel) else inner._orig_mod
    return inner
