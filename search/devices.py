"""Which devices this host offers, as the --devices flag and the hardware say."""

from __future__ import annotations

import os
from dataclasses import dataclass


class DeviceError(ValueError):
    """--devices is malformed or names a device this host does not have."""


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    index: int  # GPU index as the host numbers it, or the CPU worker's ordinal

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.index}"


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


def threads_per_worker(devices: list[Device]) -> int | None:
    """CPU workers split the cores, or take ``OMP_NUM_THREADS`` each when it is set; GPU
    workers keep torch's default.

    On a machine shared with other jobs, fewer threads than cores is often faster: OpenMP
    threads that wait for a busy core stall every operation of the step.
    """
    cpu = [d for d in devices if d.kind == "cpu"]
    if not cpu:
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // len(cpu))
