"""Which devices this host offers, as the --devices flag and the hardware say."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


class DeviceError(ValueError):
    """--devices is malformed or names a device this host does not have."""


@dataclass(frozen=True)
class Device:
    """What one worker process trains on: one device, or a group of them (its first one and
    ``peers``, the others, for train.devices_per_trial > 1)."""

    kind: str  # "cuda" or "cpu"
    index: int  # GPU index as the host numbers it, or the CPU worker's ordinal
    peers: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.kind}:{'+'.join(str(i) for i in (self.index, *self.peers))}"

    @property
    def count(self) -> int:
        return 1 + len(self.peers)


def visible_gpus() -> list[int]:
    # torch.cuda.device_count() asks NVML without creating a CUDA context in the parent.
    import torch

    return list(range(torch.cuda.device_count()))


def parse(value: str | None) -> list[Device]:
    """``None``: every GPU, else one CPU worker. ``0,1``: those GPUs. ``cpu:2``: two CPU workers."""
    if value is None or value.strip() == "":
        gpus = visible_gpus()
        return [Device("cuda", i) for i in gpus] if gpus else [Device("cpu", 0)]
    value = value.strip()
    if value == "cpu" or value.startswith("cpu:"):
        count_text = value.partition(":")[2] or "1"
        if not count_text.isdigit() or not 1 <= int(count_text) <= (os.cpu_count() or 1) * 4:
            raise DeviceError(
                f"--devices {value}: the CPU worker count must be an integer from 1 to {(os.cpu_count() or 1) * 4}"
            )
        return [Device("cpu", i) for i in range(int(count_text))]
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() for p in parts):
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


def group(devices: list[Device], per_trial: int, flag: str | None) -> list[Device]:
    """The devices in groups of ``per_trial`` (train.devices_per_trial), one worker per group.

    With no ``--devices`` on a host without GPUs, the default is one group of CPU ranks.
    """
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
    """CPU ranks split the cores, or take ``OMP_NUM_THREADS`` each when it is set; GPU
    workers keep torch's default.

    On a machine shared with other jobs, fewer threads than cores is often faster: OpenMP
    threads that wait for a busy core stall every operation of the step.
    """
    cpu = sum(d.count for d in devices if d.kind == "cpu")  # a device group runs one rank per device
    if not cpu:
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // cpu)


def torch_device(kind: str) -> Any:
    """The torch device a worker or peer rank of ``kind`` ("cuda" or "cpu") trains on."""
    import torch  # not at import time: the CLI starts without torch

    # The supervisor narrowed CUDA_VISIBLE_DEVICES to the process's own GPU: it is always cuda:0.
    return torch.device("cuda:0" if kind == "cuda" else "cpu")


def check_precision(requested: str, devices: list[Device]) -> None:
    """Refuse a train.precision that a listed device cannot run (fp16 on a CPU, bf16 on a GPU
    older than Ampere) before anything is stored: every trial would fail on it."""
    import torch

    from hpsearch.trainer import precision
    from hpsearch.trainer.config import ConfigError

    if any(d.kind == "cpu" for d in devices):
        precision.resolve(requested, torch.device("cpu"))
    gpus = sorted({i for d in devices if d.kind == "cuda" for i in (d.index, *d.peers)})
    if requested == "bf16" and gpus:
        # Asked in a throwaway process: a CUDA context in the supervisor would hold memory on
        # GPU 0 for the whole search. Only an explicit bf16 can fail on a GPU (fp16 runs anywhere).
        import multiprocessing as mp

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
