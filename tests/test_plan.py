"""The memory plan: its terms are what the tiny models really allocate; `start` refuses a plan far over the
device's memory (set low through the tests' override) before anything is written; `hpsearch plan` prints it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hpsearch.search.study import plan as plans
from hpsearch.search.study.spec import StudySpec, tomllib
from hpsearch.search.workers.devices import Device
from hpsearch.trainer import held, memory, meta_model
from hpsearch.trainer.config import AdapterConfig
from hpsearch.trainer.model import PretrainedCache
from tests.conftest import Cli, assert_refused, spec_text

LORA = AdapterConfig(method="lora", r=4)


def _real(model_dir: Path, adapter: AdapterConfig | None, task: str) -> dict[str, int]:
    """What one training step really allocates: parameters, gradients (before zero_grad) and AdamW moments."""
    labels = None
    if task == "classification":
        from hpsearch.trainer.labels import LabelMap

        labels = LabelMap(("negative", "positive"), numeric=False)
    model = PretrainedCache().trial_model(str(model_dir), labels, 0, adapter, private=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.tensor([[5, 6, 7]])
    kwargs = {"labels": ids} if task == "causal-lm" else {"labels": torch.tensor([1])}
    model(input_ids=ids, **kwargs).loss.backward()
    optimizer.step()
    return held.held_bytes(model, optimizer)


@pytest.mark.parametrize("adapter", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_the_plans_terms_are_what_a_tiny_model_allocates(
    tiny_gpt2: Path, tiny_model: Path, adapter: AdapterConfig | None, task: str
) -> None:
    model_dir = tiny_gpt2 if task == "causal-lm" else tiny_model
    meta, shape = meta_model.meta_model(str(model_dir), task)
    assert next(meta.parameters()).device.type == "meta", "no weights read"
    if adapter is not None:
        meta = meta_model.with_adapter(meta, adapter, task)
    est = memory.estimate(meta, shape, memory.Setup("fp32", micro_batch=4, length=32))
    real = _real(model_dir, adapter, task)
    assert (est.weights, est.gradients, est.optimizer) == (real["parameters"], real["gradients"], real["optimizer"])
    # fsdp over 2: each of the three halves (up to FSDP's padding of a dimension to an even size).
    half = memory.estimate(meta, shape, memory.Setup("fp32", 4, 32, sharding="fsdp", devices=2))
    assert half.weights == -(-est.weights // 2) and half.optimizer == -(-est.optimizer // 2)
    assert half.gathered > 0 and half.activations == est.activations


def test_start_refuses_a_plan_far_over_the_devices_memory_before_writing_anything(
    cli: Cli, tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(spec_text(tiny_model, *demo_files))
    need = plans.make(StudySpec.from_dict(tomllib.loads(spec.read_text())), [Device("cpu", 0)], 10**12).estimate
    # Half of what a trial needs: LoRA (most of the tiny model is its embeddings, frozen then) does not fit
    # either; a micro-batch of 1 does.
    monkeypatch.setattr(plans, "device_memory", lambda _devices: need.total // 2)
    line = assert_refused(cli, spec, tmp_path, "memory plan: ")
    assert "more than cpu:0's" in line and "would fit: micro_batch_size = " in line, line
    assert not (tmp_path / "hpsearch-runs").exists()


def test_a_close_plan_is_a_warning(
    tiny_model: Path, demo_files: tuple[Path, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = StudySpec.from_dict(tomllib.loads(spec_text(tiny_model, *demo_files)))
    need = plans.make(spec, [Device("cpu", 0)], 10**12).estimate.total
    monkeypatch.setattr(plans, "device_memory", lambda _devices: int(need / 1.1))
    with caplog.at_level(logging.INFO):
        plan = plans.check(spec, [Device("cpu", 0)])
    assert plan.verdict == "close" and plan.record()["total"] == need
    assert any(r.levelno == logging.WARNING and "close to cpu:0's" in r.message for r in caplog.records)


def _llama_spec(tmp_path: Path) -> Path:
    """A Llama-3-8B full fine-tune's spec; its model folder holds the config alone: the plan reads no weights."""
    from transformers import LlamaConfig

    folder = tmp_path / "llama-3-8b"
    LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    ).save_pretrained(folder)
    spec = tmp_path / "llama.toml"
    spec.write_text(
        f'[model]\nname = "{folder}"\ntask = "causal-lm"\nmax_length = 2048\n'
        '[data]\ntrain = "t.jsonl"\nvalidation = "v.jsonl"\n'
        '[train]\nbatch_size = 8\nmicro_batch_size = 1\nprecision = "bf16"\n'
        '[search]\nmetric = "loss"\n[search.space]\nlearning_rate = { type = "float", low = 1e-5, high = 1e-4 }\n'
    )
    return spec


def test_hpsearch_plan_prints_a_llama_3_8b_full_fine_tune_with_and_without_sharding(cli: Cli, tmp_path: Path) -> None:
    spec = _llama_spec(tmp_path)
    result = cli("plan", "--study", "llama", "--config", str(spec), "--device-memory", "80", cwd=tmp_path)
    assert result.returncode == 2, result.stderr  # an 80 GB card does not hold it: refused as `start` would
    lines = result.stdout.splitlines()
    # A bf16 checkpoint trains with fp32 masters: 8.03e9 fp32 weights 29.9 GiB, as much for the gradients, twice
    # that for AdamW's two fp32 moments (16 bytes a parameter), autocast's bf16 copies 15.0 GiB; 32 layers of
    # 2048 x 4096 activations.
    assert lines[0].startswith(
        "memory plan: 145.1 GiB per device (weights 29.9 GiB, gradients 29.9 GiB, optimizer 59.8 GiB, "
        "16-bit copies 15.0 GiB, activations 10.5 GiB; bf16-mixed: fp32 masters, 16 bytes a trained parameter"
    ), lines[0]
    # Only what fits 80 GiB (at 0.9 of it) is offered: LoRA and fsdp over 4, not fsdp over 2 (73.1 GiB).
    assert lines[0].endswith(
        'more than the device\'s 80.0 GiB; would fit: [adapter] method = "lora": 26.1 GiB; '
        'sharding = "fsdp" over 4 devices: 43.1 GiB'
    ), lines[0]
    fsdp2 = next(line for line in lines if 'sharding = "fsdp" over 2 devices' in line)
    assert fsdp2.split()[-1] == "GiB" and "15.0 GiB" in fsdp2 and "73.1 GiB" in fsdp2
    # bf16-true: bf16 weights, gradients, moments and compensation, 10 bytes a parameter: 0.59 of the mixed plan.
    true = next(line for line in lines if 'precision = "bf16-true"' in line)
    assert true.split()[-2:] == ["85.2", "GiB"], true
    small = cli("plan", "--study", "llama", "--config", str(spec), "--device-memory", "24", cwd=tmp_path)
    assert "more than the device's 24.0 GiB; would fit: " in small.stdout
    assert small.stdout.splitlines()[0].endswith('would fit: sharding = "fsdp" over 16 devices: 20.7 GiB')
    tiny = cli("plan", "--study", "llama", "--config", str(spec), "--device-memory", "4", cwd=tmp_path)
    # Nothing tried fits 4 GiB: it says so, with the smallest figure, and lists nothing as fitting.
    assert "would fit" not in tiny.stdout.splitlines()[0]
    assert tiny.stdout.splitlines()[0].endswith(
        'nothing tried fits (the smallest: sharding = "fsdp" over 16 devices: 20.7 GiB)'
    )


@pytest.mark.parametrize(
    ("gib", "code", "verdict"),
    [(24, 2, "more than the device's 24.0 GiB"), (140, 0, "close to the device's 140.0 GiB")],
    ids=["refused", "close"],
)
def test_hpsearch_plan_exits_as_start_would(cli: Cli, tmp_path: Path, gib: int, code: int, verdict: str) -> None:
    """145.1 GiB needed: on 24 GiB `start` refuses it (exit 2, its one line); on 140 GiB it is a close call (exit 0)."""
    spec = _llama_spec(tmp_path)
    result = cli("plan", "--study", "llama", "--config", str(spec), "--device-memory", str(gib), cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert verdict in result.stdout.splitlines()[0], result.stdout
    assert any("as specified" in line for line in result.stdout.splitlines()), "the table is printed either way"
    assert "Traceback" not in result.stderr
    if code:
        assert result.stderr.startswith("hpsearch plan: error: memory plan: 145.1 GiB per device"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and verdict in result.stderr, result.stderr
    else:
        assert "error" not in result.stderr, result.stderr


@pytest.mark.parametrize("adapter", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("requested", ["bf16", "fp32", "bf16-true"])
def test_each_precisions_terms_are_what_the_trainer_allocates_for_a_bf16_checkpoint(
    tmp_path: Path, tiny_gpt2: Path, requested: str, adapter: AdapterConfig | None
) -> None:
    """The plan and the trainer read one policy: for a checkpoint stored in bf16, the weights, gradients and
    optimizer state a real step holds (the trainer's own loader, policy and optimizer) are the plan's terms."""
    from hpsearch.trainer import precision as prec
    from hpsearch.trainer.config import TrainConfig
    from hpsearch.trainer.optim import build_optimizer
    from tests.support.tiny import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path / "llama", tiny_gpt2, torch.bfloat16)
    compute = prec.resolve(requested, torch.device("cpu"))
    model = PretrainedCache().trial_model(str(model_dir), None, 0, adapter, private=True, precision=requested)
    policy = prec.policy(requested, compute, torch.bfloat16, adapter=adapter is not None)
    prec.apply(model, policy)
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"), compensated=policy.compensated)
    ids = torch.tensor([[5, 6, 7]])
    with prec.autocast(compute, torch.device("cpu")):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    real = held.held_bytes(model, optimizer)

    meta, shape = meta_model.meta_model(str(model_dir), "causal-lm")
    assert shape.stored == torch.bfloat16
    if adapter is not None:
        meta = meta_model.with_adapter(meta, adapter, "causal-lm")
    est = memory.estimate(meta, shape, memory.Setup(compute, 4, 32, adapter=adapter, requested=requested))
    assert (est.weights, est.gradients, est.optimizer) == (real["parameters"], real["gradients"], real["optimizer"])
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = {"bf16": 16, "fp32": 16, "bf16-true": 16 if adapter else 10}[requested]
    assert est.bytes_per_trained == expected and est.regime == policy.regime
    # Autocast's bf16 copy of each fp32 trained weight (bf16-true's adapter trains in fp32 too).
    copied = requested == "bf16" or (requested == "bf16-true" and adapter is not None)
    assert est.casts == (2 * trained if copied else 0)
