"""Which devices this host offers, as the --devices flag and the hardware say."""

from __future__ import annotations

import glob
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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


BusyNow = Callable[[frozenset[int]], float]
"""How many CPUs' worth of work is running now on these CPU ids (0.0 to their count): what ``threads_per_worker``
leaves alone. The default samples /proc/stat; the supervisor could pass a longer sample, a test a known machine."""

PROC_STAT = Path("/proc/stat")
SAMPLE_SECONDS = 0.3
"""How long ``sample_busy`` watches the CPUs: ~30 kernel ticks at 100 Hz, enough to tell a busy core (a training
process keeps one ~100% busy) from an idle one, short enough not to slow `start`."""


def threads_per_worker(devices: list[Device], busy_now: BusyNow | None = None) -> int | None:
    """CPU ranks split the cores this process may run on that other work leaves free now, or take
    ``OMP_NUM_THREADS`` each when the user set it; GPU workers: torch's. Torch's own default is every core of the
    machine for each process: two workers, or one beside another busy job, then run more threads than cores, and
    an OpenMP thread waiting for a busy core stalls every operation (15 steps of the bert-lr demo took 61-67 s so,
    5 s with one thread on 2 cores). Too few threads costs at most their share; too many cost 12x: so a busy core
    is left out. ``busy_now``: what counts as busy (default ``sample_busy``, a short sample of /proc/stat)."""
    cpu = sum(d.count for d in devices if d.kind == "cpu")  # a device group runs one rank per device
    if not cpu:
        return None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    usable = usable_cpus()
    busy = busy_cpus(len(usable), (busy_now or sample_busy)(usable))
    return max(1, (len(usable) - busy) // cpu)


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not the machine's."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def busy_cpus(usable: int, busy: float) -> int:
    """CPUs to leave to other work that keeps ``busy`` CPUs' worth busy, at most all but one. A CPU more than a
    quarter busy counts whole: a thread that shares a core waits on it, and every operation waits for its slowest
    thread (too many threads cost 12x, one too few its share)."""
    return min(usable - 1, max(0, math.ceil(busy - 0.25)))


def sample_busy(cpus: frozenset[int], seconds: float = SAMPLE_SECONDS) -> float:
    """CPUs' worth of time that work kept ``cpus`` busy over the next ``seconds``, from two reads of /proc/stat
    (this process sleeps between them, so it is not counted). Not the load average, which still counts for a
    minute a job that has just ended: a worker started after it on an idle machine would train on too few
    cores. Where /proc/stat is not (not Linux), the load average it is."""
    try:
        before = cpu_times(PROC_STAT.read_text())
        time.sleep(seconds)
        after = cpu_times(PROC_STAT.read_text())
    except OSError:
        return _load_average()
    seen = cpus & before.keys() & after.keys()
    if not seen:  # a mask of CPUs /proc/stat does not list (an odd container): say what the kernel's load says
        return _load_average()
    busy = 0.0
    for i in seen:
        worked, elapsed = after[i][0] - before[i][0], after[i][1] - before[i][1]
        busy += worked / elapsed if elapsed > 0 else 0.0
    return busy


def cpu_times(stat: str) -> dict[int, tuple[int, int]]:
    """Each CPU's (busy, total) time in ticks since boot, from /proc/stat's ``cpuN`` lines (proc(5)): user, nice,
    system, idle, iowait, irq, softirq, steal. Idle and iowait are free (a core waiting on I/O runs a thread
    at once); steal is not (the hypervisor gave the core to someone else); guest and guest_nice are already in
    user and nice. Older kernels print fewer fields: the missing ones are 0."""
    times: dict[int, tuple[int, int]] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue  # the "cpu" total, interrupts, context switches...
        fields = [int(f) for f in rest.split()[:8]]
        fields += [0] * (8 - len(fields))
        free = fields[3] + fields[4]
        total = sum(fields)
        times[int(name[3:])] = (total - free, total)
    return times


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # unavailable
        return 0.0


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
