"""Fault injection for tests that run hpsearch in other processes (a CLI, its workers, their ranks), where pytest's
monkeypatch cannot reach. A test puts this folder on PYTHONPATH (``faults.env``) with the fault it wants; Python
imports this module as each process starts, and only then is the product touched: it carries no test hook itself.

HPSEARCH_FAULT_OOM="RANK:STEP:MICRO": rank RANK runs out of memory in the forward/backward of every optimizer step
from STEP on whenever its micro-batch is larger than MICRO, as a device too small for it would (a CPU never does).
"""

from __future__ import annotations

import os
from typing import Any

if fault := os.environ.get("HPSEARCH_FAULT_OOM"):
    import torch

    from hpsearch.trainer import step as _step

    _at_rank, _from_step, _fits = (int(v) for v in fault.split(":"))
    _current = {"step": 0}
    _train_step, _accumulate = _step.train_step, _step._accumulate

    def train_step(model: Any, parts: Any, batches: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        _current["step"] = step
        return _train_step(model, parts, batches, step, *args, **kwargs)

    def accumulate(model: Any, data: Any, mine: list[list[int]], *args: Any) -> Any:
        world = args[-1]
        micro = max((len(ids) for ids in mine), default=0)
        if world.rank == _at_rank and _current["step"] >= _from_step and micro > _fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by HPSEARCH_FAULT_OOM={fault})")
        return _accumulate(model, data, mine, *args)

    _step.train_step, _step._accumulate = train_step, accumulate
    from hpsearch.trainer import loop as _loop

    _loop.train_step = train_step  # loop.py imported it by name
