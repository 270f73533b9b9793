"""Sharded trials (train.sharding = "fsdp"): FSDP2 over the ranks of one trial (docs/multi-gpu.md).

Each rank holds 1/N of every parameter, gradient and AdamW moment; a block's full weights exist on a rank only
while its forward or backward runs (all-gathered, then freed). What is sharded is accelerate's choice, as its
FSDP plugin makes it (one group per transformer block, the classes a model's ``_no_split_modules`` names, then the
root); the wrapping itself and the loop are torch's ``fully_shard`` (docs/decisions.md, "Sharding: accelerate
chooses, torch shards, our loop trains"). Checkpoints: the best model is gathered to rank 0 (on the CPU) and saved
as one Hugging Face folder; the resumable state stays sharded, each rank writing its own part
(``torch.distributed.checkpoint``), read back without unpickling anything a rank did not make itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hpsearch.storage import regular
from hpsearch.trainer.config import ConfigError

log = logging.getLogger(__name__)

SHARDS = "shards"
"""The folder of the sharded part of a resumable state, beside its state.pt (storage/trialdir.py's ``resume/``)."""


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


def empty_model(name: str, labels: Any, adapter: Any) -> torch.nn.Module:
    """A sharded trial's model on a rank other than the first: built from the config on the meta device (no weights
    read, no host copy), with the trial's adapter; :func:`shard_from_first` fills its shards from rank 0's model."""
    from hpsearch.trainer.memory import meta_model, with_adapter

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


def shard_from_first(model: torch.nn.Module, precision: str, device: torch.device, world: Any) -> int:
    """Shard the trial's model over its ranks, where rank 0's is real (in host memory) and the others' are
    :func:`empty_model`'s: one host copy of the model, not N. Every rank shards its module (rank 0's blocks move
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """What this rank really holds, measured from its local shards: parameters, gradients (after a step's
    backward, before zero_grad) and optimizer state."""
    params = list(model.parameters())
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    return {
        "parameters": sum(_local(p).nbytes for p in params),
        "gradients": sum(_local(p.grad).nbytes for p in params if p.grad is not None),
        "optimizer": sum(_local(v).nbytes for v in moments),
        "trained": sum(_local(p).nbytes for p in params if p.requires_grad),  # what its gradients take in a step
    }


def full_state(model: torch.nn.Module, *, trained_only: bool) -> dict[str, torch.Tensor]:
    """The consolidated state dict for the best model: a collective (every rank calls it), gathered block by
    block into rank 0's host memory (``cpu_offload``), so no device ever holds the whole model; the other ranks
    get an empty dict. ``trained_only``: an adapter's folder needs only what trains, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only)
    return get_model_state_dict(model, options=options)  # type: ignore[return-value]


def save_shards(model: torch.nn.Module, optimizer: Any, folder: Path, *, trained_only: bool) -> list[dict[str, Any]]:
    """Write this rank's part of the model and optimizer moments into ``folder`` (a collective: every rank calls
    it with the same folder); returns the optimizer's param_groups (plain numbers), which the caller keeps with
    the rest of the state. Only tensors go to the shards: anything else would be pickled there, and unpickled
    when read back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=trained_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optim_state["state"]}, storage_writer=_writer(folder))
    return optim_state["param_groups"]  # type: ignore[return-value]


def load_shards(
    model: torch.nn.Module, optimizer: Any, folder: Path, param_groups: list[dict[str, Any]], *, trained_only: bool
) -> None:
    """Put back what :func:`save_shards` wrote, each rank reading the slices its own shards need (a collective).
    Raises ``UnsafeCheckpoint`` for a folder whose index names anything but tensors or plain metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(ignore_frozen_params=trained_only)
    # Templates of the right shapes and sharding (the optimizer's moments are made first if it has not stepped).
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    target: dict[str, Any] = {"model": model_state, "optimizer": optim_state["state"]}
    try:
        dcp.load(target, storage_reader=_SafeReader(folder))
    except CheckpointException as exc:
        # One rank's failure is every rank's (torch gathers them), but as a BaseException, which no handler of an
        # ordinary error would see: an ordinary one, raised by every rank alike (trainer/state.py DamagedState).
        first = next(iter(exc.failures.values()), None)
        said = str(first).splitlines()[0] if first is not None and str(first) else type(first).__name__
        raise RuntimeError(f"ranks {sorted(exc.failures)} could not read their shards ({said})") from None
    optim = {"state": target["optimizer"], "param_groups": param_groups}
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=optim, options=options)


def _writer(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    # One file per rank (its own part); no thread pool: the ranks already write side by side.
    return FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True, thread_count=1)


class UnsafeCheckpoint(ValueError):
    """A sharded state's index names something other than tensors and their metadata: never loaded."""


# What torch.distributed.checkpoint's index (.metadata, a pickle) may name: its own dataclasses and the plain
# torch values they hold. Anything else (os.system, a class with a side-effecting constructor) is refused before it
# is looked up: Python's "Restricting Globals" (docs/decisions.md, "No pickle from disk").
_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "strided", "sparse_coo", *(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name not in _INDEX_GLOBALS.get(module, ()):
            raise UnsafeCheckpoint(f"the sharded state's index names {module}.{name}: refused")
        return super().find_class(module, name)


MAX_INDEX_BYTES = 256 * 2**20
"""The index of a sharded state lists each tensor's chunks: a few MB for the largest models, never this much."""
MAX_DIMS = 8


def check_shards(folder: Path) -> str | None:
    """Why the sharded part of a resumable state in ``folder`` cannot be read, or None. Every rank calls it before
    the collective load (trainer/state.py): an index or shard file that is not one, or whose numbers point outside
    the files, is found here, where each rank can say so, not inside torch's reader, where one rank's failure would
    leave the others waiting in a collective (or abort them)."""
    try:
        metadata = _SafeReader(folder).read_metadata()
        return _check_index(folder, metadata)
    except Exception as exc:  # a garbled pickle raises anything: all of it means "not usable"
        return f"{type(exc).__name__}: {exc}"


def _check_index(folder: Path, metadata: Any) -> str | None:
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return "the index lists no files"
    sizes: dict[str, int] = {}
    for info in storage.values():
        name, offset, length = str(info.relative_path), info.offset, info.length
        if name not in sizes:
            fd = regular.open_fd(folder / name)  # a regular file of the folder, reached through no link
            try:
                sizes[name] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        if not (_count(offset, zero=True) and _count(length) and offset + length <= sizes[name]):
            return f"{name}: bytes {offset!r} + {length!r} lie outside its {sizes[name]:,} bytes"
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            return f"{fqn!r} is not a tensor"
        shape = list(item.size)
        if len(shape) > MAX_DIMS or not all(_count(n, zero=True) for n in shape):
            return f"{fqn!r} has the shape {shape!r}"
        for chunk in item.chunks:
            offsets, lengths = list(chunk.offsets), list(chunk.sizes)
            inside = len(offsets) == len(lengths) == len(shape) and all(
                _count(o, zero=True) and _count(n, zero=True) and o + n <= d
                for o, n, d in zip(offsets, lengths, shape, strict=True)
            )
            if not inside:
                return f"a chunk of {fqn!r} ({offsets} + {lengths}) lies outside its shape {shape}"
            where = storage.get(MetadataIndex(fqn, chunk.offsets))
            if where is None:
                return f"a chunk of {fqn!r} is in no file"
            numel = 1
            for n in lengths:
                numel *= n
            if where.length < numel * item.properties.dtype.itemsize:
                return f"a chunk of {fqn!r} needs {numel:,} values, more than its {where.length:,} bytes hold"
    return None


def _count(value: Any, *, zero: bool = False) -> bool:
    """A non-negative integer (positive unless ``zero``), not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero else 1)


def _SafeReader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

    class RegularFiles(FileSystem):
        """torch's file access, opening only regular files through no link (storage/regular.py): a FIFO put in
        place of a shard must not hang a rank inside the collective load."""

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if mode != "rb":
                raise UnsafeCheckpoint(f"the sharded state's reader opens nothing to write ({path})")
            with regular.open_file(Path(path), "rb") as stream:
                yield stream

    class SafeReader(FileSystemReader):
        """torch's reader, but its index is read with the restricted unpickler above, and an index that lists
        non-tensor items (which torch would ``torch.load`` with ``weights_only=False``) is refused."""

        def __init__(self, folder: Path) -> None:
            super().__init__(str(folder))
            self.fs = RegularFiles()
            self.folder = folder

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            index = regular.read_bytes(self.folder / ".metadata", MAX_INDEX_BYTES)
            metadata = _IndexUnpickler(io.BytesIO(index)).load()
            items = getattr(metadata, "state_dict_metadata", None)
            if not isinstance(items, dict):
                raise UnsafeCheckpoint("the sharded state's index is not one torch.distributed.checkpoint wrote")
            pickled = [k for k, v in items.items() if isinstance(v, BytesStorageMetadata)]
            if pickled:
                raise UnsafeCheckpoint(f"the sharded state holds pickled items ({pickled[:3]}): refused")
            # Every file the index names is a plain file of this folder: no "../", no link out of it.
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                name = str(getattr(info, "relative_path", ""))
                part = self.folder / name
                if Path(name).name != name or part.is_symlink() or self.folder.is_symlink():
                    raise UnsafeCheckpoint(f"the sharded state's index names {name!r}, not a file of its folder")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)
