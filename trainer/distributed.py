"""Data parallelism over the devices of one host, with torch.distributed (see docs/multi-gpu.md).

Rank 0 alone talks to the search; its decisions are broadcast, so every rank leaves the loop at
the same step. With one device, ``World()`` is a single rank and every method here is a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpsearch.trainer.sharding import is_sharded

HOST = "127.0.0.1"  # the ranks of a trial share one host
# The collectives' own sockets too: gloo and NCCL would otherwise listen on the address the
# host name resolves to, reachable from the rest of the network, unauthenticated.
LOOPBACK_IFNAME = "lo"


@dataclass
class World:
    rank: int = 0
    size: int = 1
    control: Any = None  # a gloo group for decisions: a broadcast of a CPU flag there never waits for the GPU

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """DDP around ``model``; a sharded model (trainer/sharding.py) is its own wrapper already."""
        if self.size == 1 or is_sharded(model):
            return model
        ids = [device.index or 0] if device.type == "cuda" else None
        # The gradients are views into DDP's all-reduce buckets: without it each rank holds a second, bucket-sized
        # copy of every gradient (the memory plan counts the gradients once).
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def no_sync(self, model: torch.nn.Module, is_accumulating: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP all-reduces the gradients in every backward pass: while a step accumulates, only its last one syncs.
        FSDP reduce-scatters every micro-batch's gradients: each rank keeps only its shard of the step's sum, where
        skipping the sync would hold every block's full gradients until the step's end (docs/decisions.md)."""
        if self.size == 1 or not is_accumulating or is_sharded(model):
            return contextlib.nullcontext()
        return model.no_sync()  # type: ignore[operator]

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:  # in place
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def from_main(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (what the others pass is ignored)."""
        if self.size == 1:
            return flag
        value = torch.tensor([int(flag)])
        dist.broadcast(value, src=0, group=self.control)
        return bool(value.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a process that has been a rank of a group, skipping the interpreter's shutdown. A gloo thread may still
    be releasing a finished collective's tensors when the main thread exits (the model keeps the group alive past
    ``close``); that release takes the GIL, and during shutdown Python ends any thread that asks for it, which inside
    gloo's C++ aborts the process: SIGABRT, "terminate called without an active exception", after a run that went
    well (pytorch#179291; one exit in four in a test of two FSDP ranks). The logs are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``), created before the others start.
    The socket is bound here and handed over: given only a host name, TCPStore's server listens on
    every interface, and anyone who reaches the port could join or stall the trial's group."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # detach(): the store owns the descriptor now (a garbage-collected socket would close it under the store).
    return dist.TCPStore(HOST, port, size, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def join(rank: int, size: int, port: int, device: torch.device, store: dist.TCPStore | None = None) -> World:
    """Join the trial group (every rank calls this; rank 0 passes its ``main_store``)."""
    if store is None:
        store = dist.TCPStore(HOST, port, size, is_master=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    # With nccl, decisions go through a second, CPU (gloo) group: see World.control.
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return World(rank=rank, size=size, control=control)


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests on two ranks mean equal parameters."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode())
        h.update(param.detach().contiguous().flatten().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
