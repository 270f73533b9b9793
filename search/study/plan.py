"""The memory plan: before a trial runs, what it needs per device (trainer/memory.py's arithmetic) against what each
device has, and when it does not fit, what would make it fit, with numbers. `start` and `worker` refuse a plan far
over the device's memory (exit 2, before the study is touched) and warn of a close one; `hpsearch plan` prints it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, replace
from typing import Any

from hpsearch.search.study.spec import StudySpec
from hpsearch.search.workers.devices import Device
from hpsearch.trainer.config import AdapterConfig, ConfigError
from hpsearch.trainer.memory import Estimate, Setup, estimate, gib
from hpsearch.trainer.meta_model import meta_model, with_adapter

log = logging.getLogger(__name__)

FITS = 0.9  # of the device's memory: the rest is the CUDA context, the allocator's slack, what the estimate misses
REFUSED = 1.3  # over this much more than the device has, no back-off saves the trial: refused
SHARD_COUNTS = (2, 4, 8, 16)


class PlanError(ConfigError):
    """The plan needs far more memory than the device has: one line, exit 2."""


@dataclass(frozen=True)
class Plan:
    estimate: Estimate
    setup: Setup
    memory: int | None  # bytes per device, None when unknown
    device: str
    fixes: list[tuple[str, Estimate]]  # the changes that alone would fit (or, if none does, come closest)
    alternatives: list[tuple[str, Estimate]]  # every change tried, for `hpsearch plan`

    @property
    def ratio(self) -> float | None:
        return self.estimate.total / self.memory if self.memory else None

    @property
    def verdict(self) -> str:
        r = self.ratio
        return "unknown" if r is None else "fits" if r <= FITS else "close" if r <= REFUSED else "too_big"

    def line(self) -> str:
        e = self.estimate
        terms = (
            f"weights {gib(e.weights)}, gradients {gib(e.gradients)}, optimizer {gib(e.optimizer)}"
            + (f", 16-bit copies {gib(e.casts)}" if e.casts else "")
            + (f", gathered blocks {gib(e.gathered)}" if e.gathered else "")
            + f", activations {gib(e.activations)}"
        )
        how = _describe(self.setup, e)
        need = f"memory plan: {gib(e.total)} per device ({terms}; {how})"
        if self.memory is None:
            return f"{need}; the device's memory is unknown"
        have = f"{self.device}'s {gib(self.memory)}"
        if self.verdict == "fits":
            return f"{need}: fits {have}"
        word = "close to" if self.verdict == "close" else "more than"
        fitting = [(change, e) for change, e in self.fixes if e.total <= FITS * self.memory]
        if fitting:
            return f"{need}: {word} {have}; would fit: " + "; ".join(f"{c}: {gib(e.total)}" for c, e in fitting[:4])
        if self.fixes:
            change, smallest = min(self.fixes, key=lambda t: t[1].total)
            return f"{need}: {word} {have}; nothing tried fits (the smallest: {change}: {gib(smallest.total)})"
        return f"{need}: {word} {have}; nothing tried fits"

    def record(self) -> dict[str, Any]:
        """What the study keeps (attrs.MEMORY_PLAN) and `status` shows."""
        return {"line": self.line(), "verdict": self.verdict, "memory": self.memory, **self.estimate.as_dict()}


def setup_of(spec: StudySpec, precision: str) -> Setup:
    """The spec's worst case: the largest micro-batch its space can sample, checkpointing off if searched."""
    train, space = spec.train, spec.space
    micro: Any = train.micro_batch_size
    if "micro_batch_size" in space:
        micro = max(v for v in space["micro_batch_size"].checked_values() if isinstance(v, int))
    if micro == "auto":
        batch = max([train.batch_size, *space["batch_size"].checked_values()] if "batch_size" in space else [1])
        micro = max(1, int(batch) // train.devices_per_trial)
    checkpointing = train.gradient_checkpointing and "gradient_checkpointing" not in space
    adapter = spec.adapter
    if "adapter.r" in space:
        adapter = replace(adapter, r=max(int(v) for v in space["adapter.r"].checked_values()))
    return Setup(
        requested=train.precision,
        precision=precision,
        micro_batch=int(micro),
        length=spec.model.max_length,
        checkpointing=checkpointing,
        sharding=train.sharding,
        devices=train.devices_per_trial,
        adapter=adapter if adapter.enabled else None,
        quantization=spec.model.quantization,
    )


def make(spec: StudySpec, device_list: list[Device], memory: int | None = None, *, every_fix: bool = False) -> Plan:
    """The plan of ``spec`` on this host's ``device_list`` (or on devices of ``memory`` bytes); the changes that
    would make it fit are worked out when it does not (``every_fix``: always, with every change tried)."""
    kind = device_list[0].kind if device_list else "cpu"
    setup = setup_of(spec, _precision(spec.train.precision, kind))
    device = "the device" if memory is not None or not device_list else device_list[0].label
    memory = memory if memory is not None else device_memory(device_list)
    plan = Plan(_estimate(spec, setup), setup, memory, device, [], [])
    if not every_fix and (memory is None or plan.verdict == "fits"):
        return plan
    tried = [(change, _estimate(spec, s)) for change, s in _changes(setup, kind)]
    return replace(plan, fixes=_fixes(tried, plan.estimate, memory), alternatives=tried)


def _estimate(spec: StudySpec, setup: Setup) -> Estimate:
    labels = 2  # a classifier's head is a rounding error next to the base
    model, shape = meta_model(spec.model.name, spec.model.task, labels)
    if setup.adapter is not None:
        model = with_adapter(model, setup.adapter, spec.model.task)
    return estimate(model, shape, setup)


def _changes(setup: Setup, kind: str) -> list[tuple[str, Setup]]:
    """Each change of the spec worth trying alone, as the setup it gives."""
    tries: list[tuple[str, Setup]] = []
    if setup.sharding == "none" and setup.quantization == "none":
        tries += [
            (f'sharding = "fsdp" over {n} devices', replace(setup, sharding="fsdp", devices=n)) for n in SHARD_COUNTS
        ]
    elif setup.sharding == "fsdp":
        tries.append(('sharding = "none" (each device holds it all)', replace(setup, sharding="none", devices=1)))
        tries += [(f"devices_per_trial = {n}", replace(setup, devices=n)) for n in SHARD_COUNTS if n > setup.devices]
    if not setup.checkpointing:
        tries.append(("gradient_checkpointing = true", replace(setup, checkpointing=True)))
    if setup.adapter is None and setup.requested != "bf16-true" and (kind == "cuda" or setup.precision == "bf16"):
        tries.append(('precision = "bf16-true"', replace(setup, requested="bf16-true", precision="bf16")))
    micro = setup.micro_batch // 2
    while micro >= 1:
        tries.append((f"micro_batch_size = {micro}", replace(setup, micro_batch=micro)))
        micro //= 2
    if setup.adapter is None:
        lora = AdapterConfig(method="lora")
        tries.append(('[adapter] method = "lora"', replace(setup, adapter=lora)))
        if kind == "cuda" and setup.sharding == "none":
            tries.append(('QLoRA (quantization = "4bit", LoRA)', replace(setup, adapter=lora, quantization="4bit")))
    return tries


def _fixes(tried: list[tuple[str, Estimate]], now: Estimate, memory: int | None) -> list[tuple[str, Estimate]]:
    """The changes that alone fit ``memory``, least memory first: of the shard counts and micro-batches only the
    first that fits (the least change); if none fits, the two that come closest."""
    if memory is None:
        return []
    smaller = [t for t in tried if t[1].total < now.total]
    fit = [t for t in smaller if t[1].total <= FITS * memory]
    firsts = [next((t for t in fit if t[0].startswith(p)), None) for p in ("sharding", "devices_per", "micro")]
    others = [t for t in fit if not t[0].startswith(("sharding", "devices_per", "micro"))]
    chosen = sorted([t for t in firsts if t is not None] + others, key=lambda t: t[1].total)
    return chosen or sorted(smaller, key=lambda t: t[1].total)[:2]


def _describe(setup: Setup, e: Estimate) -> str:
    masters = "fp32 masters" if e.regime in ("fp32", "bf16-mixed", "fp16-mixed") else "bf16 weights, no fp32 masters"
    parts = [
        f"{e.regime}: {masters}, {e.bytes_per_trained} bytes a trained parameter",
        f"micro-batch {setup.micro_batch} x {setup.length} tokens",
    ]
    if setup.adapter is not None:
        parts.append(f"LoRA r={setup.adapter.r}")
    if setup.quantization != "none":
        parts.append(setup.quantization)
    if setup.sharding == "fsdp":
        parts.append(f"fsdp over {setup.devices}")
    if setup.checkpointing:
        parts.append("gradient checkpointing")
    return ", ".join(parts)


def _precision(requested: str, kind: str) -> str:
    """The compute precision a trial of ``requested`` would resolve to on a device of ``kind``."""
    if requested == "bf16-true":
        return "bf16"
    if requested != "auto":
        return requested
    if kind == "cuda":
        return "bf16"  # without creating a CUDA context here: Ampere and newer, what hpsearch picks there
    import torch

    return "bf16" if bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) else "fp32"


def device_memory(device_list: list[Device]) -> int | None:
    """Bytes of the smallest device (a GPU's memory; a CPU rank's share of the host's), None when unknown."""
    if device_list and device_list[0].kind == "cuda":
        gpus = {i for d in device_list for i in (d.index, *d.peers)}
        sizes = _gpu_memory()
        known = [sizes[i] for i in gpus if i in sizes]
        return min(known) if known else None
    ranks = sum(d.count for d in device_list) or 1
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # /proc/meminfo's MemTotal
    except (OSError, ValueError):  # a name this system does not know
        return None
    return total // ranks  # CPU ranks share the host's memory


def _gpu_memory() -> dict[int, int]:
    """Each GPU's total memory from nvidia-smi: asking torch would create a CUDA context in this process."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    query = [exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
        return {int(i): int(mb) * 2**20 for i, mb in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def check(spec: StudySpec, device_list: list[Device]) -> Plan | None:
    """The plan for `start` / `worker`: refused (PlanError) when far over; a warning when close; logged. None when
    the model cannot be built from its config here (an architecture the meta device does not take): said, not fatal."""
    try:
        plan = make(spec, device_list)
    except ConfigError:
        raise
    except Exception as exc:  # the inputs were checked before: a model whose config the meta device does not take
        log.warning("memory plan: cannot estimate %s here (%s); no plan", spec.model.name, type(exc).__name__)
        return None
    refuse(plan)
    if plan.verdict == "close":
        log.warning("%s (a trial that runs out of memory on one device retries with half the micro-batch)", plan.line())
    else:
        log.info("%s", plan.line())
    return plan


def refuse(plan: Plan) -> None:
    """The one rule for a plan that no back-off can save: PlanError (one line, exit 2), for `start`, `worker` and
    `hpsearch plan` alike."""
    if plan.verdict == "too_big":
        raise PlanError(plan.line())
