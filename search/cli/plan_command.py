"""`hpsearch plan`: the memory plan of a spec (a file, or a study's stored one), printed with what each change
would need per device. Reads config.json only: a model too big for this host can be planned here."""

from __future__ import annotations

import argparse
import sys
from contextlib import closing
from pathlib import Path

from hpsearch.search.errors import UsageError
from hpsearch.search.presets import resolved
from hpsearch.search.study import plan as plans, studies
from hpsearch.search.study.spec import StudySpec, load_file
from hpsearch.search.workers import devices
from hpsearch.storage import urls
from hpsearch.storage.open import open_storage

MIN_DEVICE_GIB = 0.001
"""The least --device-memory planned for: about a mebibyte. Below it the plan's whole bytes round to nothing and every
trial "would fit"."""


def cmd_plan(args: argparse.Namespace) -> int:
    check_device_memory(args.device_memory)  # a bad argument is said before the spec or the storage is read
    plan = plan_for(_spec(args), args.devices, args.device_memory)
    print(plan.line())
    heads = ("weights", "gradients", "optimizer", "16-bit copy", "gathered", "activations", "total")
    print(f"  {'per device':<44}" + "".join(f"{h:>12}" for h in heads))
    for change, e in [("as specified", plan.estimate), *plan.alternatives]:
        cells = (e.weights, e.gradients, e.optimizer, e.casts, e.gathered, e.activations, e.total)
        print(f"  {change:<44}" + "".join(f"{plans.gib(b):>12}" for b in cells))
    # The table first (what would fit is the answer the user came for), then the verdict `start` would give.
    sys.stdout.flush()
    plans.refuse(plan)
    return 0


def check_device_memory(gib: float | None) -> None:
    """--device-memory (``hpsearch.plan``'s device_memory) in its range, before anything is read for the plan."""
    if gib is not None and not MIN_DEVICE_GIB <= gib < 2**20:
        raise UsageError(
            f"--device-memory {gib:g}: must be a number of GiB from {MIN_DEVICE_GIB:g} (about 1 MiB: "
            "no device holds a model in less, and the plan counts whole bytes) to below 1048576 (a pebibyte)"
        )


def plan_for(spec: StudySpec, devices_text: str | None, device_memory_gib: float | None) -> plans.Plan:
    """The memory plan of ``spec`` on ``devices_text`` (``--devices``: this host's by default), or on devices of
    ``device_memory_gib`` GiB, with every change tried: `hpsearch plan` prints it, ``hpsearch.plan`` returns it."""
    check_device_memory(device_memory_gib)
    spec = resolved(spec, Path("hpsearch-runs"))  # a builtin:// model is built there, as start would
    device_list = devices.group(devices.parse(devices_text), spec.train.devices_per_trial, devices_text)
    memory = int(device_memory_gib * 2**30) if device_memory_gib is not None else None
    return plans.make(spec, device_list, memory, every_fix=True)


def _spec(args: argparse.Namespace) -> StudySpec:
    if args.config is not None:
        return load_file(args.config)
    with closing(open_storage(urls.resolve(args.storage), create=False, read_only=True)) as storage:
        return studies.stored_spec(storage, args.study)
