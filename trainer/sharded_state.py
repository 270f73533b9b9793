"""A sharded trial's resumable state on disk (train.sharding = "fsdp"): each rank writes and reads its own part
with ``torch.distributed.checkpoint``, and the index is read through a restricted unpickler that takes only the
checkpoint's own metadata classes, its files only from its own folder (docs/architecture.md, "Who may tell a worker
what")."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hpsearch.storage import regular

SHARDS = "shards"
"""The folder of the sharded part of a resumable state, beside its state.pt (storage/trialdir.py's ``resume/``)."""


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
