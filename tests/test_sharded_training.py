"""Sharded trials (train.sharding = "fsdp") over two real gloo ranks on CPU: the update one device makes, each
rank holding half of it, a best model plain transformers loads, and a resumable state that is every rank's own."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer import distributed, held, memory, meta_model, sharded_state, sharding
from hpsearch.trainer.config import AdapterConfig, DataConfig, TrainConfig
from hpsearch.trainer.distributed import World
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import Run, fit
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from tests.support.tiny import build_tiny_gpt2, files_in

CPU = torch.device("cpu")
# 192 examples, global batch 16 = micro-batch 4 x 2 ranks x 2 accumulation steps; clipping on (a global norm).
CFG = TrainConfig(
    learning_rate=3e-3,
    batch_size=16,
    micro_batch_size=4,
    max_steps=4,
    eval_every=2,
    precision="fp32",
    seed=3,
    resume_every_minutes=0,
)
FSDP = replace(CFG, sharding="fsdp", devices_per_trial=2)
LORA = AdapterConfig(method="lora", r=4, dropout=0.0)


def _fit(
    model_dir: str,
    data_files: tuple[str, str],
    cfg: TrainConfig,
    out: Path,
    world: World,
    adapter: Any = None,
    task: str = "causal-lm",
) -> tuple[dict[str, torch.Tensor], Any]:
    """Train; every rank returns the whole model's parameters (gathered from the shards) and the result."""
    tokenizer = load_tokenizer(model_dir)
    data = prepare(DataConfig(train=data_files[0], validation=data_files[1]), tokenizer, 48, None, task=task)
    if cfg.sharding == "fsdp" and world.rank > 0:  # as a peer rank builds it: empty, filled from rank 0's
        model = meta_model.empty_model(model_dir, data.labels, adapter)
    else:
        model = PretrainedCache().trial_model(model_dir, data.labels, cfg.seed, adapter, private=True)
    metric = "loss"
    run = Run(model=model, tokenizer=tokenizer, data=data, cfg=cfg, metric=metric, device=CPU, files=files_in(out))
    run.world = world
    result = fit(run, NullReporter())
    if cfg.learning_rate > 1e3:  # the NaN test's: it ends early, pruned
        return {}, result
    assert result.status == "complete" and result.steps == cfg.max_steps
    if sharding.is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        return {k: v.detach().clone() for k, v in full.items()}, result
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result


def _rank(
    rank: int, port: int, model_dir: str, files: tuple[str, str], out: str, lora: bool, task: str, cfg: TrainConfig
) -> None:
    world = distributed.join(rank, 2, port, CPU)
    try:
        params, result = _fit(model_dir, files, cfg, Path(out), world, LORA if lora else None, task)
        # Plain strings: torch.load (weights_only) takes no enum of ours.
        reason = str(result.fail_reason) if result.fail_reason else None
        ended = {"status": str(result.status), "steps": result.steps, "reason": reason}
        torch.save({"params": params, "held": result.figures.rank_held_mb, **ended}, Path(out) / f"rank{rank}.pt")
    finally:
        world.close()
    distributed.end_process(0)  # as a product rank ends (see end_process)


def _two_ranks(
    tmp_path: Path,
    model_dir: str,
    files: tuple[str, str],
    lora: bool = False,
    task: str = "causal-lm",
    cfg: TrainConfig = FSDP,
) -> list[dict[str, Any]]:
    store = distributed.main_store(2)
    ctx = torch.multiprocessing.get_context("spawn")
    out = tmp_path / "fsdp"
    args = (store.port, model_dir, files, str(out), lora, task, cfg)
    ranks = [ctx.Process(target=_rank, args=(r, *args)) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(180)
        assert p.exitcode == 0
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def _reproduces_saved_loss(best: Path, model: torch.nn.Module, files: tuple[str, str], task: str) -> None:
    from hpsearch.trainer.evaluate import evaluate

    meta = json.loads((best / "hpsearch.json").read_text())
    data = prepare(DataConfig(train=files[0], validation=files[1]), load_tokenizer(str(best)), 48, None, task=task)
    labels = data.labels.num_labels if data.labels else 0
    metrics = evaluate(
        model, data.validation, pad_id=data.pad_id, batch_size=8, device=CPU, precision="fp32", num_labels=labels
    )
    assert meta["step"] in (2, 4)
    assert metrics.loss == pytest.approx(meta["val_loss"], rel=1e-5)


def _unsharded_bytes(model_dir: str, adapter: Any = None) -> int:
    """Parameters + AdamW moments one device really holds for this model (measured after a real step)."""
    model = PretrainedCache().trial_model(model_dir, None, 0, adapter, private=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    mine = held.held_bytes(model, optimizer)
    return mine["parameters"] + mine["optimizer"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_sharded_ranks_reach_one_devices_parameters_holding_half_each(
    tmp_path: Path, lm_files: tuple[Path, Path], lora: bool
) -> None:
    model_dir = str(build_tiny_gpt2(tmp_path / "m", dropout=0.0))  # dropout would differ between runs
    files = (str(lm_files[0]), str(lm_files[1]))
    rank0, rank1 = _two_ranks(tmp_path, model_dir, files, lora)
    single, _ = _fit(model_dir, files, CFG, tmp_path / "single", World(), LORA if lora else None)
    initial = PretrainedCache().trial_model(model_dir, None, CFG.seed, LORA if lora else None, private=True)
    moved = 0
    for name, value in single.items():
        # Same data, same update; only the order of float additions (and the all-gathers) differs.
        torch.testing.assert_close(rank0["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(rank1["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
        moved += int(not torch.equal(value, initial.state_dict()[name]))
    assert moved >= (4 if lora else 10), "training must change the parameters"
    # Each rank held about half of what one device holds (FSDP pads a dimension to a multiple of 2: "about").
    whole_mb = _unsharded_bytes(model_dir, LORA if lora else None) / 2**20
    held = rank0["held"]
    assert held == rank1["held"] and len(held) == 2
    for mb in held:
        assert 0.45 * whole_mb < mb < 0.56 * whole_mb, (held, whole_mb)
    # The memory plan's sharded terms are what each rank held (to FSDP's padding of a dimension to an even size).
    meta, shape = meta_model.meta_model(model_dir, "causal-lm")
    if lora:
        meta = meta_model.with_adapter(meta, LORA, "causal-lm")
    planned = memory.estimate(meta, shape, memory.Setup("fp32", 4, 48, sharding="fsdp", devices=2))
    assert (planned.weights + planned.optimizer) / 2**20 == pytest.approx(held[0], rel=0.02)
    if lora:  # the adapter folder, as AutoPeftModelForCausalLM loads it
        from hpsearch.trainer.adapters import load_saved

        _reproduces_saved_loss(tmp_path / "fsdp" / "best", load_saved(tmp_path / "fsdp" / "best"), files, "causal-lm")


def test_sharded_best_checkpoint_loads_with_from_pretrained_and_reproduces_its_loss(
    tmp_path: Path, lm_files: tuple[Path, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = str(build_tiny_gpt2(tmp_path / "m", dropout=0.0))
    files = (str(lm_files[0]), str(lm_files[1]))
    _two_ranks(tmp_path, model_dir, files)
    best = tmp_path / "fsdp" / "best"
    assert json.loads((best / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    _reproduces_saved_loss(best, AutoModelForCausalLM.from_pretrained(best), files, "causal-lm")
    # The resumable state of step 2 (resume_every_minutes = 0): each rank's own part, and rank 0's plain rest.
    assert sorted(p.name for p in (tmp_path / "fsdp" / "resume" / "shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_sharded_lora_classifier_saves_an_adapter_folder_autopeftmodel_loads(
    tmp_path: Path, demo_files: tuple[Path, Path]
) -> None:
    """LoRA on a sharded frozen base, a classifier: its head and adapters train, the base is sharded too."""
    from hpsearch.trainer.adapters import load_saved
    from tests.support.tiny import build_tiny_bert

    model_dir = str(build_tiny_bert(tmp_path / "bert", dropout=0.0))
    files = (str(demo_files[0]), str(demo_files[1]))
    rank0, rank1 = _two_ranks(tmp_path, model_dir, files, lora=True, task="classification")
    assert rank0["held"] == rank1["held"]
    best = tmp_path / "fsdp" / "best"
    assert (best / "adapter_config.json").exists() and not (best / "model.safetensors").exists()
    model = load_saved(best, num_labels=2)  # AutoPeftModelForSequenceClassification, as a user loads it
    _reproduces_saved_loss(best, model, files, "classification")


def test_a_sharded_trial_whose_loss_turns_nan_is_pruned_on_every_rank_at_one_step(
    tmp_path: Path, lm_files: tuple[Path, Path]
) -> None:
    model_dir = str(build_tiny_gpt2(tmp_path / "m", dropout=0.0))
    diverging = replace(FSDP, learning_rate=1e6, max_grad_norm=0.0, max_steps=6, eval_every=3)
    ranks = _two_ranks(tmp_path, model_dir, (str(lm_files[0]), str(lm_files[1])), cfg=diverging)
    assert [(r["status"], r["reason"], r["steps"]) for r in ranks] == [("pruned", "nan_loss", 3)] * 2


def test_a_sharded_state_whose_index_names_code_is_refused_unrun(tmp_path: Path) -> None:
    """The index of a sharded state is a pickle (torch.distributed.checkpoint's .metadata); a shared runs folder
    may hold one someone else wrote. Only the checkpoint's own dataclasses and plain torch values load."""
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(sharded_state.UnsafeCheckpoint, match=r"names posix\.system"):
        sharded_state._SafeReader(folder).read_metadata()
    assert not marker.exists()


def test_a_sharded_state_whose_index_names_a_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    """The index says which file holds each tensor; a rewritten one could send a rank to read any file."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    folder = tmp_path / "shards"
    folder.mkdir()
    index = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("../../secret", 0, 8)})
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(sharded_state.UnsafeCheckpoint, match="not a file of its folder"):
        sharded_state._SafeReader(folder).read_metadata()
    # The same index naming its own file is read (the restricted unpickler takes the checkpoint's classes).
    good = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 8)})
    (folder / ".metadata").write_bytes(pickle.dumps(good))
    assert (
        sharded_state._SafeReader(folder).read_metadata().storage_data[MetadataIndex("w")].relative_path
        == "__0_0.distcp"
    )


def test_a_bf16_checkpoint_shards_fp32_masters_as_the_plan_says(
    tmp_path: Path, lm_files: tuple[Path, Path], tiny_gpt2: Path
) -> None:
    """precision bf16 on a checkpoint stored in bf16, sharded over 2 gloo ranks: each rank holds fp32 master shards
    and fp32 moments (bf16 only gathered for compute), and that is the plan's sharded figure."""
    from tests.support.tiny import build_tiny_llama

    model_dir = str(build_tiny_llama(tmp_path / "llama", tiny_gpt2, torch.bfloat16))
    files = (str(lm_files[0]), str(lm_files[1]))
    cfg = replace(FSDP, precision="bf16", learning_rate=2e-4)
    rank0, rank1 = _two_ranks(tmp_path, model_dir, files, cfg=cfg)
    assert {v.dtype for v in rank0["params"].values()} == {torch.float32}, "fp32 masters, gathered whole"
    meta, shape = meta_model.meta_model(model_dir, "causal-lm")
    planned = memory.estimate(meta, shape, memory.Setup("bf16", 4, 48, sharding="fsdp", devices=2, requested="bf16"))
    assert planned.regime == "bf16-mixed" and planned.bytes_per_trained == 16
    assert rank0["held"] == rank1["held"]
    assert (planned.weights + planned.optimizer) / 2**20 == pytest.approx(rank0["held"][0], rel=0.02)
    saved = json.loads((tmp_path / "fsdp" / "best" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16"  # the best model in the checkpoint's own dtype
