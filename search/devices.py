"""Which devices this host offers, as the --devices flag and the hardware say."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class DeviceError(ValueError):
    """--devices is malformed or names a device this host does not have."""


@dataclass(frozen=True)
class Device:
    """What one worker process trains on: one device, or a group (``peers``: train.devices_per_trial > 1)."""

    kind: str  # "cuda" or "cpu"
    index: int  # GPU index as the host numbers it, or the CPU worker's ordinal
    peers: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.kind}:{'+'.join(str(i) for i in (self.index, *self.peers))}"

    @property
    def count(self) -> int:
        return 1 + len(self.peers)

    def child_ids(self) -> tuple[str, ...]:
        """Each device of the group as its process is told: a CUDA_VISIBLE_DEVICES entry, a CPU rank's ordinal."""
        indices = (self.index, *self.peers)
        return cuda_ids(indices) if self.kind == "cuda" else tuple(map(str, indices))


def visible_gpus() -> list[int]:
    # torch.cuda.device_count() asks NVML without creating a CUDA context in the parent.
    import torch

    return list(range(torch.cuda.device_count()))


def parse(value: str | None) -> list[Device]:
    """``None``: every GPU, else one CPU worker. ``0,1``: those GPUs. ``cpu:2``: two CPU workers."""
    if value is None or value.strip() == "":
        gpus = visible_gpus()
        if gpus:
            return [Device("cuda", i) for i in gpus]
        unusable = host_nvidia_gpus()
        if unusable and not _gpus_hidden():
            # On a GPU instance the CPU costs GPU-hours for a fraction of the speed: say so, do not fall back.
            raise DeviceError(
                f"--devices (default: every GPU): this host has {unusable} NVIDIA GPU(s) but {_why_torch_sees_none()}; "
                "install a CUDA build of torch that the driver supports (nvidia-smi shows its CUDA version), "
                "or pass --devices cpu:1 to train on the CPU"
            )
        return [Device("cpu", 0)]
    value = value.strip()
    if value == "cpu" or value.startswith("cpu:"):
        count_text, most = value.partition(":")[2] or "1", (os.cpu_count() or 1) * 4
        if not _is_number(count_text) or not 1 <= int(count_text) <= most:
            raise DeviceError(f"--devices {value}: the CPU worker count must be an integer from 1 to {most}")
        return [Device("cpu", i) for i in range(int(count_text))]
    # "cuda:0,cuda:1" is how PyTorch spells them; the same as "0,1".
    parts = [p.strip().removeprefix("cuda:") for p in value.split(",")]
    if not all(_is_number(p) for p in parts):
        raise DeviceError(f"--devices {value}: use GPU indices like 0,1 or cpu:N for N CPU workers")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise DeviceError(f"--devices {value}: a GPU is listed twice")
    gpus = visible_gpus()
    missing = [i for i in indices if i not in gpus]
    if missing:
        have = ", ".join(map(str, gpus)) or "none"
        raise DeviceError(
            f"--devices {value}: no GPU {missing[0]} on this host (GPUs: {have}); use cpu:N to run on CPU"
        )
    return [Device("cuda", i) for i in indices]


def _is_number(text: str) -> bool:
    # str.isdigit() also says yes to "²" (which int() refuses) and to Arabic-Indic digits (which int() reads).
    return text.isascii() and text.isdigit()


def host_nvidia_gpus() -> int:
    """NVIDIA GPUs the driver gives this machine or container (/dev/nvidiaN), whether or not torch can use them."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _gpus_hidden() -> bool:
    """CUDA_VISIBLE_DEVICES set to hide every GPU ("" or "-1"): the CPU is what the user asked for."""
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    return visible is not None and (visible.strip() == "" or visible.strip().startswith("-"))


def _why_torch_sees_none() -> str:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use them (driver older than that CUDA?)"


def cuda_ids(indices: Iterable[int]) -> tuple[str, ...]:
    """What CUDA_VISIBLE_DEVICES must hold for a child to see this process's GPU ``i``, for each of ``indices``.

    Under CUDA_VISIBLE_DEVICES=2,3, GPU 0 here is the host's GPU 2: a child told "0" would train on somebody
    else's. The entries are passed on as written (indices, GPU-... UUIDs, MIG-...)."""
    visible = os.environ.get(CUDA_VISIBLE_DEVICES)
    if visible is None:
        return tuple(str(i) for i in indices)
    entries = [entry.strip() for entry in visible.split(",")]
    return tuple(entries[i] for i in indices)


@contextmanager
def only_gpu(cuda_id: str | None) -> Iterator[None]:
    """Processes started in the block see only the GPU ``cuda_id`` (from ``cuda_ids``) as GPU 0; None: no change.
    A spawned child copies the environment at its start, before its torch exists."""
    if cuda_id is None:
        yield
        return
    saved = os.environ.get(CUDA_VISIBLE_DEVICES)
    os.environ[CUDA_VISIBLE_DEVICES] = cuda_id
    try:
        yield
    finally:
        if saved is None:
            del os.environ[CUDA_VISIBLE_DEVICES]
        else:
            os.environ[CUDA_VISIBLE_DEVICES] = saved


def group(devices: list[Device], per_trial: int, flag: str | None) -> list[Device]:
    """The devices in groups of ``per_trial`` (train.devices_per_trial), one worker per group; with no
    ``--devices`` on a host without GPUs, one group of CPU ranks."""
    if per_trial == 1:
        return devices
    if flag is None and devices == [Device("cpu", 0)]:
        devices = [Device("cpu", i) for i in range(per_trial)]
    if len(devices) % per_trial:
        kind = devices[0].kind
        example = f"cpu:{per_trial}" if kind == "cpu" else ",".join(str(d.index) for d in devices[:per_trial])
        raise DeviceError(
            f"--devices {flag or '(all GPUs)'}: {len(devices)} devices cannot be split into groups of "
            f"train.devices_per_trial = {per_trial}; give a multiple of {per_trial} devices "
            f"(e.g. --devices {example}) or change train.devices_per_trial"
        )
    return [
        Device(devices[i].kind, devices[i].index, tuple(d.index for d in devices[i + 1 : i + per_trial]))
        for i in range(0, len(devices), per_trial)
    ]


def threads_per_worker(devices: list[Device]) -> int | None:
    """CPU ranks split the cores this process may run on that other work leaves free, or take ``OMP_NUM_THREADS``
    each when the user set it; GPU workers: torch's. Torch's own default is every core of the machine for each
    process: two workers, or one beside another busy job, then run more threads than cores, and an OpenMP thread
    waiting for a busy core stalls every operation (15 steps of the bert-lr demo took 61-67 s so, 5 s with one
    thread on 2 cores). Too few threads costs at most their share; too many cost 12x: so a busy core is left out."""
    cpu = sum(d.count for d in devices if d.kind == "cpu")  # a device group runs one rank per device
    if not cpu:
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    usable = usable_cpus()
    return max(1, (usable - busy_cpus(usable)) // cpu)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy_cpus(usable: int) -> int:
    """CPUs other work keeps busy, as the last minute's load average says (read before any worker starts, so it
    is not ours; a search that just ended still counts for a minute), at most all but one."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # unavailable
        return 0
    return min(usable - 1, max(0, round(load)))


def torch_device(kind: str) -> Any:
    import torch  # not at import time: the CLI starts without torch

    # The supervisor narrowed CUDA_VISIBLE_DEVICES to the process's own GPU: it is always cuda:0.
    return torch.device("cuda:0" if kind == "cuda" else "cpu")


def check_precision(requested: str, devices: list[Device]) -> None:
    """Refuse a train.precision that a listed device cannot run (fp16 on a CPU, bf16 before Ampere) before
    anything is stored: every trial would fail on it."""
    import torch

    from hpsearch.trainer import precision
    from hpsearch.trainer.config import ConfigError

    if any(d.kind == "cpu" for d in devices):
        precision.resolve(requested, torch.device("cpu"))
    gpus = sorted({i for d in devices if d.kind == "cuda" for i in (d.index, *d.peers)})
    if requested == "bf16" and gpus:
        # Asked in a throwaway process: a CUDA context in the supervisor would hold memory on
        # GPU 0 for the whole search. Only an explicit bf16 can fail on a GPU (fp16 runs anywhere).
        with mp.get_context("spawn").Pool(1) as pool:
            capability = pool.apply(_capabilities, (gpus,))
        old = [i for i, major in zip(gpus, capability, strict=True) if major < 8]
        if old:
            listed = ", ".join(str(i) for i in old)
            raise ConfigError(
                f"train.precision: bf16 needs an Ampere or newer GPU, and GPU {listed} is older; use fp16 or auto"
            )


def _capabilities(gpus: list[int]) -> list[int]:
    """Each GPU's compute capability major version (8 = Ampere: bf16 in hardware)."""
    import torch

    return [torch.cuda.get_device_capability(i)[0] for i in gpus]
