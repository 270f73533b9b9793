"""Plain, typed configuration of one fine-tune, with validation that names the field.

The trainer receives it merged (spec defaults + the trial's sampled values); it knows nothing of studies."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

PRECISIONS = ("auto", "bf16", "fp16", "fp32", "bf16-true")
TASKS = ("classification", "regression", "multi-label", "token-classification", "causal-lm")
TASK_METRICS = {
    "classification": ("loss", "accuracy", "f1"),
    "regression": ("loss", "pearson", "spearman"),
    "multi-label": ("loss", "f1", "macro_f1", "accuracy"),
    "token-classification": ("loss", "f1", "precision", "recall", "accuracy"),
    "causal-lm": ("loss", "perplexity"),
}
"""The validation metrics each task records (docs/tasks.md says how each is computed); the first is minimised, the
others maximised. A search's metric must be one of its task's (perplexity is exp(loss): search the loss)."""
QUANTIZATIONS = ("none", "4bit", "8bit")
ADAPTER_METHODS = ("none", "lora")
SHARDINGS = ("none", "fsdp")


MAX_STEPS = 10**9
"""Optimizer steps (and other step counts) beyond any trial that ends: a larger number is a typo."""
LIMITS = {
    "batch_size": 10**7,
    "micro_batch_size": 10**7,
    "epochs": 100_000,
    "max_steps": MAX_STEPS,
    "eval_every": MAX_STEPS,
}
"""Upper bounds of TrainConfig's counts, checked before any rule that combines them (a batch_size of 10**23 is too
large, not "not divisible")."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the rule."""


@dataclass
class ModelConfig:
    name: str = ""
    """Local path or hub id, loaded with AutoTokenizer and AutoModelForSequenceClassification (tasks
    "classification", "regression", "multi-label"), AutoModelForTokenClassification ("token-classification") or
    AutoModelForCausalLM ("causal-lm")."""
    max_length: int = 128
    """Tokens per example; longer texts are truncated."""
    task: Literal["classification", "regression", "multi-label", "token-classification", "causal-lm"] = "classification"
    """classification: text -> one label (loss, accuracy, macro f1). regression: text -> a number (MSE loss,
    pearson, spearman). multi-label: text -> a set of labels (BCE loss, micro f1, macro_f1, exact-match accuracy).
    token-classification: words -> a tag each (loss, entity f1/precision/recall, token accuracy). causal-lm:
    next-token prediction on text (or on the response of a prompt/response pair), objective loss (docs/tasks.md)."""
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """QLoRA: load the frozen base in 4-bit NF4 (bf16 compute) or 8-bit through bitsandbytes,
    CUDA only, with [adapter] method = "lora"; "none" loads it as saved."""

    def validate(self, where: str = "model") -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"{where}.quantization: {self.quantization!r} must be one of {', '.join(QUANTIZATIONS)}")
        if not self.name:
            raise ConfigError(f"{where}.name: missing; set it to a local model folder or a hub id")
        if self.task not in TASKS:
            raise ConfigError(f"{where}.task: {self.task!r} must be one of {', '.join(TASKS)}")
        if not 8 <= self.max_length <= 65536:
            raise ConfigError(f"{where}.max_length: {self.max_length} must be between 8 and 65536")


@dataclass
class DataConfig:
    train: str = ""
    """Training file: .jsonl, .json (a list of rows), .csv, .tsv, .parquet or .arrow, each optionally .gz (relative
    paths resolve against the spec file)."""
    validation: str = ""
    """Validation file, in any of those formats; the objective is measured on it."""
    dataset: str = ""
    """Instead of train: a `datasets` save_to_disk folder (a DatasetDict, or one Dataset), or a hub dataset id read
    from this host's Hugging Face cache (or through HF_ENDPOINT)."""
    train_split: str = "train"
    """data.dataset: the split trained on."""
    validation_split: str = "validation"
    """data.dataset: the split measured on (unless data.validation or data.validation_fraction says otherwise)."""
    validation_fraction: float = 0.0
    """With no validation data: this share of the training rows is held out for validation, chosen by split_seed
    (stratified by label for classification); the same rows on every worker."""
    split_seed: int = 0
    """Which rows validation_fraction holds out, and validation_rows scores; fixed for the study (not the trials'
    train.seed)."""
    validation_rows: int = 0
    """Score every validation point of every trial on the same N validation rows (drawn by split_seed), and only
    the trial's best point again on all of them at its end, for the trial's value: cheaper points, noisier choice
    of the best (docs/data.md, "Cheaper validation"). 0: every point scores every row."""
    header: bool = True
    """.csv/.tsv: the first row names the columns. false: every row is an example (AG News as
    distributed), and the columns below are positions, 0 being the first."""
    text_column: str | int = "text"
    """Column (or JSON key) holding the input text (causal-lm: the whole text is trained on);
    its position (0, 1, ...) when header = false."""
    label_column: str | int = "label"
    """Column holding the label: integers, or strings that are mapped to ids and saved (classification); a number
    (regression); a list of labels, or a string of them cut at label_separator (multi-label); a list of tags, one a
    word of text_column's list (token-classification)."""
    text_pair_column: str | int = ""
    """classification, regression: a second text per row (NLI's hypothesis, STS's second sentence), encoded as a
    sentence pair after text_column's; "" = none."""
    label_separator: str = ""
    """multi-label: cuts a string label into labels ("sports|politics" with "|"); "" = labels are JSON lists."""
    prompt_column: str | int = "prompt"
    """causal-lm: a row without text_column holds a prompt here; it is not trained on."""
    response_column: str | int = "response"
    """causal-lm: the response that follows the prompt; only its tokens count in the loss."""
    messages_column: str = "messages"
    """causal-lm: a file whose rows hold this key is chat data: a list of {"role", "content"}
    messages rendered with the tokenizer's chat template; only assistant turns count in the loss."""
    max_dropped_share: float = 0.05
    """causal-lm: the share of a file's rows that may be left out because every token they train on lies beyond
    model.max_length (as axolotl and LLaMA-Factory drop long sequences); more, or every row, is refused.
    Classification texts are truncated to model.max_length instead, never left out."""

    def validate(self, where: str = "data") -> None:
        self._validate_sources(where)
        for name in ("text_column", "label_column", "prompt_column", "response_column", "messages_column"):
            value = getattr(self, name)
            if value == "":
                raise ConfigError(f"{where}.{name}: must not be empty")
            if isinstance(value, int) and value < 0:
                raise ConfigError(f"{where}.{name}: {value} must be a column position >= 0 (0 = the first column)")
        if not 0 <= self.validation_fraction < 1 or not math.isfinite(self.validation_fraction):
            raise ConfigError(
                f"{where}.validation_fraction: {self.validation_fraction:g} must be >= 0 and < 1 (a share of the rows)"
            )
        if type(self.validation_rows) is not int or self.validation_rows < 0:
            raise ConfigError(
                f"{where}.validation_rows: {self.validation_rows!r} must be a positive whole number of rows (or 0: "
                "every point scores every row)"
            )
        if not 0 <= self.split_seed < 2**32:
            raise ConfigError(f"{where}.split_seed: {self.split_seed} must be between 0 and 4294967295 (2**32 - 1)")
        pair = self.text_pair_column
        if isinstance(pair, int) and pair < 0:
            raise ConfigError(f"{where}.text_pair_column: {pair} must be a column position >= 0 (0 = the first column)")
        if pair != "" and pair == self.text_column:
            raise ConfigError(f"{where}.text_pair_column: {pair!r} is text_column too; name the second text's column")
        if not 0 <= self.max_dropped_share < 1:
            raise ConfigError(
                f"{where}.max_dropped_share: {self.max_dropped_share:g} must be >= 0 and < 1 (a share of the rows)"
            )

    def _validate_sources(self, where: str) -> None:
        """A training source (a file or data.dataset, not both) and validation rows (a file, a dataset's split or a
        held-out share, not a file and a share)."""
        formats = ".jsonl, .json, .csv, .tsv, .parquet or .arrow"
        if self.train and self.dataset:
            raise ConfigError(
                f"{where}.dataset: set, and so is {where}.train; the training rows come from one: remove one of them"
            )
        if not self.train and not self.dataset:
            raise ConfigError(
                f"{where}.train: missing; set it to the training file's path ({formats}), or {where}.dataset to a "
                "`datasets` save_to_disk folder or a hub dataset id"
            )
        if self.validation and self.validation_fraction:
            raise ConfigError(
                f"{where}.validation_fraction: {self.validation_fraction:g} holds out training rows for validation, "
                f"but {where}.validation names a file too; remove one of them"
            )
        if not self.validation and not self.validation_fraction and not self.dataset:
            raise ConfigError(
                f"{where}.validation: missing; set it to the validation file's path ({formats}), or "
                f"{where}.validation_fraction (e.g. 0.1) to hold out a share of the training rows"
            )
        for name in ("train_split", "validation_split"):
            if not getattr(self, name):
                raise ConfigError(f"{where}.{name}: must not be empty")


@dataclass
class TrainConfig:
    learning_rate: float = 5e-5
    """Peak learning rate of AdamW, reached after warm-up, then decayed linearly to 0."""
    batch_size: int = 32
    """Effective (global) batch: examples per optimizer step, summed over the trial's devices
    (micro_batch_size x devices_per_trial x accumulation steps)."""
    micro_batch_size: int | Literal["auto"] = 16
    """Examples per forward pass on one device; "auto": batch_size / devices_per_trial."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = no cap)."""
    eval_every: int = 50
    """Optimizer steps between validation points (and one more at the end)."""
    precision: Literal["auto", "bf16", "fp16", "fp32", "bf16-true"] = "auto"
    """auto: bf16 where the hardware supports it (CPU included), else fp16 on GPU, else fp32. auto, bf16 and fp16
    are mixed: fp32 master weights, gradients and optimizer state, 16-bit compute (whatever dtype the checkpoint is
    stored in). bf16-true: bf16 weights and optimizer state with a Kahan-compensated update, for a model whose fp32
    masters do not fit (about 0.6 of the memory a parameter). fp32: everything fp32."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (not applied to biases and LayerNorm weights)."""
    warmup_ratio: float = 0.0
    """Fraction of the optimizer steps spent warming the learning rate up from 0."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (0 = no clipping)."""
    seed: int = 0
    """Seed of initialisation, shuffling and dropout."""
    group_by_length: bool = True
    """Batch examples of similar length together (shuffled buckets) to avoid padding."""
    compile: bool = False
    """Wrap the model in torch.compile (worth it for long trials on GPU)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of storing them: far less memory
    for ~30% more compute (for models or sequences that do not fit otherwise)."""
    devices_per_trial: int = 1
    """Devices of one host that train one trial together, data-parallel (DDP); the workers
    of a host get the devices in groups of this size."""
    sharding: Literal["none", "fsdp"] = "none"
    """none: every device of a trial holds the whole model, its gradients and optimizer state (data parallel).
    fsdp: they are sharded over the trial's devices (FSDP2), each holding about 1/devices_per_trial of them: for a
    model that does not fit one device (docs/multi-gpu.md). Needs devices_per_trial >= 2; not searchable."""
    resume_every_minutes: float = 5.0
    """Minimum minutes between resumable checkpoints (model + optimizer state, written at a
    validation point; 0 = at every validation point). A crash loses at most this much work;
    SIGTERM always checkpoints."""

    def validate(self, where: str = "train") -> None:
        def rule(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{where}.{name}: {getattr(self, name)!r} {msg}")

        # inf and nan pass the range rules below (or fail them with a confusing message) and
        # make a trial diverge; every float field must be an ordinary number.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rule(not isinstance(value, float) or math.isfinite(value), f.name, "must be a finite number")
        for name, most in LIMITS.items():
            value = getattr(self, name)
            rule(not isinstance(value, int) or value <= most, name, f"must be at most {most:,}")
        rule(self.learning_rate > 0, "learning_rate", "must be > 0")
        rule(self.batch_size >= 1, "batch_size", "must be >= 1")
        rule(1 <= self.devices_per_trial <= 64, "devices_per_trial", "must be between 1 and 64")
        n = self.devices_per_trial
        rule(self.sharding in SHARDINGS, "sharding", f"must be one of {', '.join(SHARDINGS)}")
        # One device has nothing to share the model with: fsdp there is a mistake, not a no-op to allow.
        rule(self.sharding == "none" or n >= 2, "sharding", f"needs devices_per_trial >= 2 (it is {n})")
        if self.micro_batch_size == "auto":
            rule(self.batch_size % n == 0, "batch_size", f"must be divisible by devices_per_trial ({n})")
        else:
            rule(self.micro_batch_size >= 1, "micro_batch_size", 'must be >= 1 or "auto"')
            if n == 1:
                divides = self.batch_size % self.micro_batch_size == 0
                rule(divides, "micro_batch_size", f"must divide batch_size ({self.batch_size})")
            else:
                # batch_size is the global batch: every device runs the same number of micro-batches.
                m = self.micro_batch_size
                per_step = f"must be a multiple of micro_batch_size x devices_per_trial ({m} x {n})"
                rule(self.batch_size % (m * n) == 0, "batch_size", per_step)
        rule(self.epochs >= 1, "epochs", "must be >= 1")
        rule(self.max_steps >= 0, "max_steps", "must be >= 0 (0 = no cap)")
        rule(self.eval_every >= 1, "eval_every", "must be >= 1")
        rule(self.precision in PRECISIONS, "precision", f"must be one of {', '.join(PRECISIONS)}")
        rule(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        rule(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        rule(self.resume_every_minutes >= 0, "resume_every_minutes", "must be >= 0 (0 = every validation point)")
        rule(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 = no clipping)")
        rule(0 <= self.seed < 2**32, "seed", "must be between 0 and 4294967295 (2**32 - 1)")


@dataclass
class AdapterConfig:
    method: Literal["none", "lora"] = "none"
    """none: full fine-tune (every weight trained). lora: the base is frozen and a low-rank
    adapter (plus a classifier's head, trained in full) is trained beside it (peft)."""
    r: int = 16
    """Rank of each LoRA update (its A and B matrices are r wide)."""
    alpha: float = 32.0
    """LoRA scaling numerator: the update is multiplied by alpha / r (2 with the defaults)."""
    dropout: float = 0.05
    """Dropout on the adapter's input (not on the frozen base's path)."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get an adapter: "all-linear" (every linear layer but the output
    head; QLoRA's recommendation), or a list of module names such as ["query", "value"]."""

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self, where: str = "adapter") -> None:
        def rule(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{where}.{name}: {getattr(self, name)!r} {msg}")

        rule(self.method in ADAPTER_METHODS, "method", f"must be one of {', '.join(ADAPTER_METHODS)}")
        rule(isinstance(self.r, int) and not isinstance(self.r, bool), "r", "must be an integer")
        rule(self.r >= 1, "r", "must be >= 1")
        rule(self.r <= 4096, "r", "must be <= 4096")
        rule(math.isfinite(self.alpha) and self.alpha > 0, "alpha", "must be a finite number > 0")
        rule(math.isfinite(self.dropout) and 0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str):
            # peft would read any other string as a regular expression: one typo adapts nothing.
            rule(targets == "all-linear", "target_modules", 'must be "all-linear" or a list of module names')
        else:
            ok = isinstance(targets, list) and bool(targets) and all(isinstance(t, str) and t for t in targets)
            rule(ok, "target_modules", 'must be "all-linear" or a non-empty list of module names')


C = TypeVar("C")


def near(key: str, known: Iterable[str], listed: str) -> str:
    """``did you mean X?`` for a typo close to a known key (difflib), else ``LISTED: every known key``: a list of
    thirty keys hides the one a user meant to type."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else f"{listed}: {', '.join(sorted(known))}"


def from_dict(cls: type[C], values: dict[str, Any], where: str) -> C:
    """Build dataclass ``cls`` from ``values``, rejecting unknown keys and wrong types."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a table, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown key; {near(key, names, 'known keys')}")
        kwargs[key] = coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


# What each plain type accepts as it is (no conversion); an integer fits a float field.
_FITS: dict[Any, Callable[[Any], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    type(None): lambda v: v is None,
}


def coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a type hint (int, float, bool, str, Literal, unions of those)."""
    origin = get_origin(hint)
    if origin is Literal:
        if value not in get_args(hint):
            allowed = ", ".join(repr(a) for a in get_args(hint))
            raise ConfigError(f"{where}: {value!r} must be one of {allowed}")
        return value
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return coerce(value, option, where)
            except ConfigError:
                continue
    elif hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    elif fits(value, hint):
        return float(value) if hint is float else value
    raise ConfigError(f"{where}: {value!r} has the wrong type; expected {describe(hint)}")


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is, as it is (no conversion), of a type ``hint`` allows."""
    origin = get_origin(hint)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return any(fits(value, option) for option in get_args(hint))
    return _FITS.get(hint, lambda v: True)(value)


def describe(hint: Any) -> str:
    """A type hint in words, for error messages ("an integer or 'auto'")."""
    origin = get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in get_args(hint))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))
