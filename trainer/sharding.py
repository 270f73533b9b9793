"""Sharded trials (train.sharding = "fsdp"): FSDP2 over the ranks of one trial (docs/multi-gpu.md).

Each rank holds 1/N of every parameter, gradient and AdamW moment; a block's full weights exist on a rank only
while its forward or backward runs (all-gathered, then freed). What is sharded is accelerate's choice, as its
FSDP plugin makes it (one group per transformer block, the classes a model's ``_no_split_modules`` names, then the
root); the wrapping itself and the loop are torch's ``fully_shard`` (docs/decisions.md, "Sharding: accelerate
chooses, torch shards, our loop trains"). Checkpoints: the best model is gathered to rank 0 (on the CPU) and saved
as one Hugging Face folder (``full_state``); the resumable state stays sharded (sharded_state.py). What a rank
holds is measured in held.py; a rank's empty model is built by memory.py ``empty_model``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hpsearch.trainer.config import ConfigError

log = logging.getLogger(__name__)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module under torch.compile) is FSDP2-sharded."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def transformers_model(model: torch.nn.Module) -> Any:
    """The transformers model: under a peft wrapper for an adapter trial."""
    inner: Any = model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def block_classes(model: torch.nn.Module) -> list[str]:
    """The class names of a model's transformer blocks: those its ``_no_split_modules`` names (transformers' own
    list of what must stay whole on one device) that it holds, else the class of the longest ``nn.ModuleList``'s
    entries (BERT names none; its ``encoder.layer`` holds its BertLayers)."""
    present = {type(m).__name__ for m in model.modules()}
    named = [n for n in getattr(model, "_no_split_modules", None) or [] if n in present]
    if named:
        return named
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    return sorted({type(m).__name__ for m in max(lists, key=len, default=[])})


def plugin(precision: str, blocks: list[str] | None = None) -> Any:
    """accelerate's FSDP2 plugin for ``precision``: what it wraps (transformer blocks), when it frees a block's
    gathered weights (after its forward: the memory is the point), and the mixed precision (weights gathered in
    bf16/fp16 for compute, gradients reduced in fp32 so the N-way sum does not lose bits)."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=blocks,
        reshard_after_forward=True,
        mixed_precision_policy=policy,
    )


def shard(model: torch.nn.Module, precision: str) -> int:
    """Shard ``model`` in place over the trial's ranks (the default process group): one ``fully_shard`` per
    transformer block, innermost first, then the root, which takes what no block holds (embeddings, final norm,
    head; a tied head shares the embedding's shard). Returns the number of blocks. Call it after the model is on
    its device and before the optimizer is built: the optimizer must hold the sharded parameters."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
    from torch.distributed.fsdp import fully_shard

    pretrained = transformers_model(model)
    fsdp = plugin(precision, block_classes(pretrained) or None)
    fsdp.set_auto_wrap_policy(pretrained)
    is_block = fsdp2_prepare_auto_wrap_policy(fsdp, pretrained)
    kwargs = {"reshard_after_forward": fsdp.reshard_after_forward, "mp_policy": fsdp.mixed_precision_policy}
    blocks = [m for m in get_module_children_bottom_up(model)[:-1] if is_block is not None and is_block(m)]
    if not blocks:
        # One group for the whole model would gather every weight at once on every rank: no memory saved.
        raise ConfigError(
            f"train.sharding: {type(pretrained).__name__} names no transformer blocks (_no_split_modules) to "
            'shard one by one; use sharding = "none"'
        )
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks)


def shard_from_first(model: torch.nn.Module, precision: str, device: torch.device, world: Any) -> int:
    """Shard the trial's model over its ranks, where rank 0's is real (in host memory) and the others' are
    memory.py ``empty_model``'s: one host copy of the model, not N. Every rank shards its module (rank 0's blocks move
    to the device one at a time as they are sharded), the empty ones get device memory for their shards only, and
    rank 0 sends each tensor, of which every rank keeps its shard. Returns the number of blocks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    layout = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    first = world.gather(layout)[0]
    if [entry[:2] for entry in first] != [entry[:2] for entry in layout]:
        # Every rank sees the same gathered layouts, so every rank raises: none waits in a collective.
        raise ConfigError(f"train.sharding: {type(model).__name__} built from its config differs from the loaded one")
    empty = next(model.parameters()).is_meta
    if empty:  # take rank 0's dtypes (a checkpoint saved in another dtype than its config says) and trainability
        dtypes = {name: (getattr(torch, dtype.removeprefix("torch.")), trains) for name, _, dtype, trains in first}
        for name, param in model.named_parameters():
            param.data = param.data.to(dtypes[name][0])
            param.requires_grad_(dtypes[name][1])
    full = {} if empty else model.state_dict()  # rank 0's weights, until they are sent
    buffers = {name: b.clone() for name, b in model.named_buffers()} if empty else {}
    blocks = shard(model, precision)
    if empty:
        model.to_empty(device=device)
        with torch.no_grad():  # to_empty left them uninitialised: the values the config computed
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    return blocks


def grad_scaler(precision: str, device: torch.device) -> Any:
    """fp16's loss scaler, which must skip a step on every rank when any rank's shard of the gradients overflows:
    torch's sharded scaler all-reduces that finding (a plain GradScaler sees only its own shard)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, enabled=precision == "fp16")


def full_state(model: torch.nn.Module, *, trained_only: bool) -> dict[str, torch.Tensor]:
    """The consolidated state dict for the best model: a collective (every rank calls it), gathered block by
    block into rank 0's host memory (``cpu_offload``), so no device ever holds the whole model; the other ranks
    get an empty dict. ``trained_only``: an adapter's folder needs only what trains, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only)
    return get_model_state_dict(model, options=options)  # type: ignore[return-value]
