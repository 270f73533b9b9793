"""How many bytes one trial needs on each of its devices, from the model's config alone: the model as
meta_model.py builds it on the meta device (shapes and dtypes, no weights read).

Arithmetic a reader can check (docs/multi-gpu.md, "The memory plan"), each dtype the trainer's own
(trainer/precision.py ``Policy``: the plan and the trial read the same one):
- weights: every trained parameter at the policy's ``trained`` dtype (fp32 masters in the mixed regimes, whatever
  the checkpoint is stored in), every frozen one (an adapter's base) at ``frozen``; a 4-bit base 0.5 byte a weight
  plus its fp32 scale per 64, an 8-bit one 1 byte; the rest upcast to fp32;
- gradients: every trained parameter, at its dtype;
- optimizer: AdamW's two moments per trained parameter, at its dtype (bf16-true: and a bf16 Kahan compensation);
- casts: under 16-bit autocast, the copy of each fp32 trained weight autocast keeps from the forward through the
  backward (2 bytes a parameter);
- sharded (fsdp over N): those three divided by N, plus what is gathered whole while it computes: the root's
  parameters (embeddings and head; FSDP keeps the root's gathered through the backward) and two blocks (the one
  computing and the one prefetched);
- activations (never sharded: each rank runs its own micro-batch): per layer 34 x micro x length x hidden bytes
  at 16 bits (Korthikanti et al. 2022, without the attention scores, which SDPA does not keep), twice that at fp32;
  with gradient checkpointing a layer keeps only its input (2 bytes a value) and one layer is recomputed at a
  time; a causal LM adds its fp32 logits and their gradient (micro x length x vocab x 8 bytes).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hpsearch.trainer import precision as prec
from hpsearch.trainer.config import AdapterConfig
from hpsearch.trainer.meta_model import Shape
from hpsearch.trainer.sharding import block_classes, transformers_model

ACTIVATION_BYTES_PER_VALUE = 34
"""Bytes stored per (token x hidden unit) per transformer layer at 16 bits for the backward pass."""
QUANTIZED_BYTES = {"4bit": 0.5 + 4 / 64, "8bit": 1.0}
"""Bytes a quantized weight takes: NF4 packs two a byte and keeps an fp32 absmax per block of 64; int8 one."""


@dataclass(frozen=True)
class Setup:
    """What the estimate depends on, besides the model."""

    precision: str  # the compute precision: "bf16", "fp16" or "fp32" (resolved)
    micro_batch: int
    length: int  # tokens per example (model.max_length)
    checkpointing: bool = False
    sharding: str = "none"
    devices: int = 1
    adapter: AdapterConfig | None = None
    quantization: str = "none"
    requested: str = "auto"  # the spec's train.precision: says whether masters are fp32 (bf16-true: not)

    def policy(self, stored: torch.dtype) -> prec.Policy:
        """The trial's precision policy for a checkpoint stored in ``stored``: what the trainer will hold."""
        return prec.policy(self.requested, self.precision, stored, adapter=self.adapter is not None)


@dataclass(frozen=True)
class Estimate:
    """Bytes per device, by term."""

    weights: int
    gradients: int
    optimizer: int
    gathered: int  # sharded: what is all-gathered whole while a block or the root computes
    activations: int
    parameters: int  # counts, for the reader
    trained: int
    casts: int = 0  # autocast's 16-bit copies of fp32 trained weights, held from the forward through the backward
    regime: str = ""  # the precision policy's name (bf16-mixed, fp32, bf16-true...)
    bytes_per_trained: int = 0  # weight + gradient + optimizer state of one trained parameter

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.casts + self.gathered + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def estimate(model: torch.nn.Module, shape: Shape, setup: Setup) -> Estimate:
    """The bytes per device for training ``model`` (on the meta device, or real) as ``setup`` says, each term at
    the dtype the trainer's precision policy gives it (not the dtype ``model`` happens to be built in)."""
    policy = setup.policy(shape.stored)
    params = list(model.parameters())
    trained = sum(p.numel() for p in params if p.requires_grad)
    quantized = _weight_bytes(model, setup.quantization)
    size = {True: _bytes(policy.trained), False: _bytes(policy.frozen)}
    weights = sum(quantized.get(id(p), p.numel() * size[p.requires_grad]) for p in params)
    gradients = trained * _bytes(policy.trained)
    optimizer = trained * (policy.trained_bytes() - 2 * _bytes(policy.trained))  # AdamW's moments (+ compensation)
    casts = trained * policy.cast_bytes()
    gathered = 0
    if setup.sharding == "fsdp" and setup.devices > 1:
        weights, gradients, optimizer = (math.ceil(b / setup.devices) for b in (weights, gradients, optimizer))
        # FSDP gathers the parameters in the compute dtype itself (its param_dtype): autocast copies nothing.
        gathered, casts = _gathered_bytes(model, setup.precision), 0
    return Estimate(
        weights=int(weights),
        gradients=gradients,
        optimizer=optimizer,
        gathered=gathered,
        activations=activation_bytes(shape, setup),
        parameters=sum(p.numel() for p in params),
        trained=trained,
        casts=casts,
        regime=policy.regime,
        bytes_per_trained=policy.trained_bytes(),
    )


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def activation_bytes(shape: Shape, setup: Setup) -> int:
    tokens = setup.micro_batch * setup.length
    scale = 2 if setup.precision == "fp32" else 1  # 34 bytes is for 16-bit values
    per_layer = ACTIVATION_BYTES_PER_VALUE * tokens * shape.hidden * scale
    if setup.checkpointing:
        # Each layer keeps its input (16-bit: 2 bytes a value); one layer's full activations while recomputed.
        stored = 2 * tokens * shape.hidden * scale * shape.layers + per_layer
    else:
        stored = per_layer * shape.layers
    logits = 8 * tokens * shape.vocab if shape.causal else 0  # fp32 logits and their gradient
    return int(stored + logits)


def _weight_bytes(model: torch.nn.Module, quantization: str) -> dict[int, float]:
    """A quantized base: its transformer blocks' linear weights at the quantized size, the rest in fp32 (what
    peft's prepare_model_for_kbit_training upcasts them to). Empty without quantization."""
    if quantization not in QUANTIZED_BYTES:
        return {}
    sizes: dict[int, float] = {id(p): p.numel() * 4 for p in model.parameters()}
    for block in _blocks(model):
        for module in block.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
                sizes[id(module.weight)] = module.weight.numel() * QUANTIZED_BYTES[quantization]
    return sizes


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(block_classes(transformers_model(model)))
    return [m for m in model.modules() if type(m).__name__ in names]


def _gathered_bytes(model: torch.nn.Module, precision: str) -> int:
    """The root's parameters and the two largest blocks', whole, at the dtype they are gathered in (the compute
    precision: FSDP's param_dtype)."""
    blocks = _blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    compute = 4 if precision == "fp32" else 2

    def size(params: Any) -> int:
        return sum(p.numel() * compute for p in params)

    root = size(p for p in model.parameters() if id(p) not in in_blocks)
    largest = sorted((size(b.parameters()) for b in blocks), reverse=True)[:2]
    return root + sum(largest)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"
