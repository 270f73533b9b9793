"""LoRA adapters: trials through the CLI, one frozen base per worker, adapter checkpoints,
their resume, retention and export (plain and merged), and bad [adapter] input."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.evaluate import evaluate
from hpsearch.trainer.loop import Run, fit, flops_per_token
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from tests.conftest import Cli, hpsearch, lm_spec_text, one_trial, spec_text, start_study
from tests.support.tiny import files_in

LORA = '[adapter]\nmethod = "lora"\nr = 4\nalpha = 8\ndropout = 0.0\n'


def with_adapter(text: str, adapter: str = LORA) -> str:
    """A spec with an [adapter] table (placed before [search], as a user would write it)."""
    return text.replace("[search]\n", adapter + "[search]\n", 1)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def base_digest(model: torch.nn.Module) -> str:
    """Every weight but the classifier head's (which each trial re-draws)."""
    body = {k: v for k, v in model.state_dict().items() if not k.startswith("classifier.")}
    h = hashlib.sha256()
    for name, tensor in sorted(body.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_two_adapter_trials_leave_the_one_base_bit_identical(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    # Imported here: on code without adapters, each test fails on its own, not at collection.
    from hpsearch.trainer import adapters
    from hpsearch.trainer.config import AdapterConfig

    tok = load_tokenizer(str(tiny_model))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    cache = PretrainedCache()
    cfg = TrainConfig(learning_rate=5e-3, batch_size=32, micro_batch_size=16, max_steps=4, eval_every=2)
    cfg.precision = "fp32"
    base = cache._base(str(tiny_model), 2, torch.float32)
    before = base_digest(base)
    losses = []
    for trial in range(2):
        model = cache.trial_model(str(tiny_model), data.labels, seed=trial, adapter=AdapterConfig(method="lora", r=4))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n or "classifier" in n for n in trainable), sorted(trainable)[:5]
        assert adapters.trainable_parameters(model) < sum(p.numel() for p in model.parameters()) / 5
        # The second trial checkpoints activations: its adapters still get gradients.
        trial_cfg = replace(cfg, gradient_checkpointing=trial == 1)
        run = Run(model, tok, data, trial_cfg, "loss", torch.device("cpu"), files_in(tmp_path / f"t{trial}"))
        tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in tables)
        assert flops_per_token(model) == pytest.approx(6 * adapters.trainable_parameters(model) + 4 * frozen)
        lora_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
        result = fit(run, NullReporter())
        assert result.status == "complete"
        moved = [n for n, p in model.named_parameters() if n in lora_b and not torch.equal(p, lora_b[n])]
        assert len(moved) == len(lora_b), f"adapters without gradient: {sorted(set(lora_b) - set(moved))[:3]}"
        assert result.attrs["trainable_parameters"] == adapters.trainable_parameters(model)
        losses.append(result.best_value)
        cache.release(model)
        assert base is cache._base(str(tiny_model), 2, torch.float32), "one base per process, never a copy"
        assert not adapters.is_adapter(base) and not any("lora_" in n for n, _ in base.named_parameters())
        assert base_digest(base) == before, f"trial {trial} changed the frozen base"
        assert getattr(base, "_require_grads_hook", None) is None
        assert not any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
        assert all(p.requires_grad for p in base.parameters()), "a full fine-tune may copy this base next"
    # Differently seeded adapters and heads: the trials are not one and the same run.
    assert losses[0] != losses[1]


def test_lora_classification_trial_from_the_cli_saves_an_adapter_that_peft_loads(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    spec = tmp_path / "spec.toml"
    space = '"adapter.r" = { type = "categorical", choices = [4, 8] }'
    # One epoch: what is checked is the adapter folder a trial saves and its size, not how far it trained.
    text = with_adapter(spec_text(tiny_model, *demo_files, n_trials=2, space=space))
    spec.write_text(text.replace("epochs = 2", "epochs = 1"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    start_study("lora", spec, url, tmp_path)
    trials = optuna.load_study(study_name="lora", storage=url).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in trials:
        assert set(t.params) == {"adapter.r"}
        assert 0 < t.user_attrs["trainable_parameters"] < 20_000, t.user_attrs["trainable_parameters"]
    best = min(trials, key=lambda t: t.value or 0)
    folder = Path(best.user_attrs["best_checkpoint"])
    assert (folder / "adapter_model.safetensors").exists() and not (folder / "model.safetensors").exists()
    size = sum(p.stat().st_size for p in folder.iterdir())
    full = sum(p.stat().st_size for p in tiny_model.glob("*.safetensors"))
    assert size < full / 2, f"an adapter folder ({size} bytes) holds far less than the model ({full})"
    assert best.user_attrs["best_checkpoint_mb"] == pytest.approx(size / 2**20, abs=0.01)
    meta = json.loads((folder / "hpsearch.json").read_text())
    assert meta["params"] == best.params

    from peft import AutoPeftModelForSequenceClassification

    loaded = AutoPeftModelForSequenceClassification.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    metrics = evaluate(
        loaded,
        data.validation,
        pad_id=data.pad_id,
        batch_size=32,
        device=torch.device("cpu"),
        precision="fp32",
        num_labels=2,
    )
    assert metrics.loss == pytest.approx(meta["val_loss"], rel=1e-4)

    # Export, plain (the adapter folder) and merged (a plain transformers model, same logits).
    plain = hpsearch("best", "--study", "lora", "--storage", url, "--export", str(tmp_path / "ad"), cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert (tmp_path / "ad" / "adapter_config.json").exists()
    merged = hpsearch(
        "best", "--study", "lora", "--storage", url, "--export", str(tmp_path / "merged"), "--merge", cwd=tmp_path
    )
    assert merged.returncode == 0, merged.stderr
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    from transformers import AutoModelForSequenceClassification

    plain_model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    loaded.eval()
    batch = tok(["good fine great", "bad terrible"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = loaded(**batch).logits
        got = plain_model(**batch).logits
    assert torch.allclose(want, got, atol=1e-5), (want, got)
    assert plain_model.config.id2label == {0: "negative", 1: "positive"}


def test_lora_causal_lm_trial_from_the_cli(tmp_path: Path, tiny_gpt2: Path, lm_files: tuple[Path, Path]) -> None:
    spec = tmp_path / "lm.toml"
    text = lm_spec_text(tiny_gpt2, *lm_files, search="[[search.enqueue]]\nlearning_rate = 1e-2")
    spec.write_text(with_adapter(text, LORA + 'target_modules = ["c_attn", "c_fc"]\n'))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    trial = one_trial("lm", spec, url, tmp_path)
    values = [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]
    assert values[-1] < values[0], f"the validation loss must fall: {values}"
    folder = Path(trial.user_attrs["best_checkpoint"])
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and sorted(config["target_modules"]) == ["c_attn", "c_fc"]
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_lora_trial_stopped_midway_resumes_its_adapter(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]
) -> None:
    # Imported here: on code without adapters, each test fails on its own, not at collection.
    from hpsearch.trainer import adapters
    from hpsearch.trainer.config import AdapterConfig

    tok = load_tokenizer(str(tiny_model))
    data = prepare(DataConfig(train=str(demo_files[0]), validation=str(demo_files[1])), tok, 32, None)
    cfg = TrainConfig(learning_rate=5e-3, batch_size=32, micro_batch_size=16, max_steps=8, eval_every=2)
    cfg.precision, cfg.resume_every_minutes = "fp32", 0.0
    cache = PretrainedCache()
    lora = AdapterConfig(method="lora", r=4)
    out = tmp_path / "trial"
    calls = {"n": 0}

    def stop_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] >= 3

    model = cache.trial_model(str(tiny_model), data.labels, 0, lora)
    run = Run(model, tok, data, cfg, "loss", torch.device("cpu"), files_in(out), should_stop=stop_after_three)
    first = fit(run, NullReporter())
    assert first.status == "interrupted" and first.steps == 3
    state = torch.load(out / "resume" / "state.pt", weights_only=True)
    assert all("lora_" in k or "classifier" in k for k in state["model"]), "only what the trial trains"
    trained = {k: v.clone() for k, v in state["model"].items()}
    cache.release(model)

    model = cache.trial_model(str(tiny_model), data.labels, 0, lora)
    reporter = NullReporter()
    run = Run(model, tok, data, cfg, "loss", torch.device("cpu"), files_in(out), resume_from=files_in(out).state)
    second = fit(run, reporter)
    assert second.status == "complete" and second.steps == 8
    assert reporter.attrs["resumed_from_step"] == 3
    after = adapters.trainable_state(model)
    assert set(after) == set(trained)
    assert any(not torch.equal(trained[k], v) for k, v in after.items()), "it trained on after the resume"
    cache.release(model)


def test_retention_deletes_adapter_checkpoints(tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path]) -> None:
    spec = tmp_path / "spec.toml"
    space = 'learning_rate = { type = "float", low = 1e-4, high = 1e-2, log = true }'
    text = with_adapter(spec_text(tiny_model, *demo_files, n_trials=3, space=space, search="keep_top_k = 1"))
    spec.write_text(text.replace("epochs = 2", "epochs = 1"))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    start_study("keep", spec, url, tmp_path)
    trials = optuna.load_study(study_name="keep", storage=url).trials
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) >= 2
    kept = [t for t in complete if (tmp_path / "runs" / "keep" / f"trial-{t.number}" / "best").exists()]
    assert len(kept) == 1
    best = min(complete, key=lambda t: t.value or 0)
    assert kept[0].number == best.number
    assert (tmp_path / "runs" / "keep" / f"trial-{best.number}" / "best" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize(
    ("adapter", "space", "message"),
    [
        ('[adapter]\nmethod = "lora"\nr = 0\n', "", "adapter.r: 0 must be >= 1"),
        ('[adapter]\nmethod = "lora"\ndropout = 1.5\n', "", "adapter.dropout: 1.5 must be in [0, 1)"),
        ('[adapter]\nmethod = "lora"\ntarget_modules = []\n', "", "adapter.target_modules: []"),
        ('[adapter]\nmethod = "lora"\ntarget_modules = "query"\n', "", "adapter.target_modules: 'query' must be"),
        (
            '[adapter]\nmethod = "lora"\ntarget_modules = ["query", "qkv"]\n',
            "",
            "adapter.target_modules: 'qkv' names no layer of",
        ),
        ('[adapter]\nmethod = "dora"\n', "", "adapter.method: 'dora' must be one of"),
        ('[adapter]\nmethod = "lora"\nrank = 8\n', "", "adapter.rank: unknown key"),
        (
            '[adapter]\nmethod = "lora"\n',
            '"adapter.r" = { type = "categorical", choices = [8, 0] }',
            "search.space.adapter.r: value 0 gives an invalid trial: adapter.r: 0 must be >= 1",
        ),
        (
            '[adapter]\nmethod = "lora"\n',
            '"adapter.rank" = { type = "categorical", choices = [8] }',
            "search.space.adapter.rank: not an [adapter] key",
        ),
        (
            "",
            '"adapter.r" = { type = "categorical", choices = [8] }',
            'search.space.adapter.r: searched, but [adapter] method is "none"',
        ),
        ('[adapter]\nmethod = "lora"\n', "", "model.quantization: '4bit' needs CUDA GPUs"),
        ("", "", "model.quantization: '4bit' needs [adapter] method = \"lora\""),
    ],
)
def test_bad_adapter_input_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path,
    tiny_model: Path,
    demo_files: tuple[Path, Path],
    cli: Cli,
    adapter: str,
    space: str,
    message: str,
) -> None:
    """`start`'s own main() in this process: twelve subprocesses importing torch and peft to refuse a spec cost
    minutes of a loaded suite and proved nothing more (the installed entry point's exit 2 is
    test_bad_input.py::test_bad_input_through_the_installed_entry_point's)."""
    text = spec_text(tiny_model, *demo_files, space=space)
    if "quantization" in message:
        text = text.replace("max_length = 32", 'max_length = 32\nquantization = "4bit"')
    spec = tmp_path / "spec.toml"
    spec.write_text(with_adapter(text, adapter) if adapter else text)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = cli(
        *("start", "--study", "bad", "--config", str(spec), "--storage", url),
        *("--devices", "cpu:1", "--output-dir", str(tmp_path / "runs")),
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "db.sqlite").exists()
    assert not (tmp_path / "runs" / "bad").exists()


def test_a_lora_study_defaults_to_ten_times_the_learning_rate_and_a_full_one_stores_no_adapter() -> None:
    from hpsearch.search.study.spec import LORA_LEARNING_RATE, StudySpec

    base = {"model": {"name": "m"}, "data": {"train": "a", "validation": "b"}}
    full = StudySpec.from_dict(base)
    lora = StudySpec.from_dict({**base, "adapter": {"method": "lora"}})
    assert lora.train.learning_rate == LORA_LEARNING_RATE == 10 * full.train.learning_rate
    given = StudySpec.from_dict({**base, "adapter": {"method": "lora"}, "train": {"learning_rate": 1e-4}})
    assert given.train.learning_rate == 1e-4
    # A full fine-tune's stored spec reads as before [adapter] existed; a LoRA one keeps its table.
    assert "adapter" not in full.to_dict()
    assert StudySpec.from_dict(lora.to_dict()).adapter == lora.adapter


def test_merge_without_export_is_a_usage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = hpsearch("best", "--study", "x", "--storage", url, "--merge", cwd=tmp_path)
    assert result.returncode == 2
    assert "--merge: goes with --export DIR" in result.stderr
    assert not (tmp_path / "db.sqlite").exists()


def test_merge_of_a_classifier_with_more_labels_than_its_base_config(tmp_path: Path, tiny_model: Path) -> None:
    """The base's config says 2 labels; a 3-class adapter loads and merges all the same."""
    from transformers import AutoModelForSequenceClassification

    from hpsearch.trainer import adapters
    from hpsearch.trainer.config import AdapterConfig

    class Labels:
        num_labels = 3
        task = "classification"  # what a LabelMap says: the model trial_model builds

        def id2label(self) -> dict[int, str]:
            return {0: "bad", 1: "fine", 2: "good"}

    cache = PretrainedCache()
    model = cache.trial_model(str(tiny_model), Labels(), 1, AdapterConfig(method="lora", r=4))
    with torch.no_grad():  # a trained-looking adapter: B is zero at first, which would merge to nothing
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    model.save_pretrained(tmp_path / "adapter")
    tok = load_tokenizer(str(tiny_model))
    adapters.merge(tmp_path / "adapter", tmp_path / "merged", tok, Labels().id2label())
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    model.eval()
    batch = tok(["good fine great", "bad terrible"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want, got = model(**batch).logits, merged(**batch).logits
    assert want.shape == (2, 3) and torch.allclose(want, got, atol=1e-5), (want, got)
    assert merged.config.id2label == {0: "bad", 1: "fine", 2: "good"}
    cache.release(model)


def test_a_lora_trial_stopped_by_sigterm_resumes_its_adapter_on_the_next_start(
    tmp_path: Path, tiny_model: Path, demo_files: tuple[Path, Path], sqlite_url: str
) -> None:
    import signal

    from tests.test_faults import _held_start, _slow_spec, _start

    spec = _slow_spec(tmp_path, tiny_model, demo_files, n_trials=1)
    # A LoRA step of the tiny model is quick (a whole trial can end before a poll of the study sees it running):
    # the trial is held at step 5 until the stop reaches it.
    spec.write_text(with_adapter(spec.read_text()))
    with _held_start(tmp_path, spec, sqlite_url, 5) as (proc, _):
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    first, retry = optuna.load_study(study_name="f", storage=sqlite_url).get_trials()
    assert first.user_attrs["fail_reason"] == "interrupted", first.user_attrs
    again = _start(tmp_path, spec, sqlite_url)
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    first, retry = optuna.load_study(study_name="f", storage=sqlite_url).get_trials()
    assert retry.state == optuna.trial.TrialState.COMPLETE
    assert retry.user_attrs["resumed_from_step"] >= 5
    assert min(retry.intermediate_values) > retry.user_attrs["resumed_from_step"]
    assert (Path(retry.user_attrs["best_checkpoint"]) / "adapter_model.safetensors").exists()


def test_qlora_loads_the_base_as_nf4_with_bf16_compute() -> None:
    """What a CUDA worker passes to from_pretrained (the load itself needs a GPU: not run here)."""
    from hpsearch.trainer import adapters
    from hpsearch.trainer.config import ModelConfig

    four = adapters.quantization_config(ModelConfig(name="m", quantization="4bit"))
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4" and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_compute_dtype == torch.bfloat16
    assert adapters.quantization_config(ModelConfig(name="m", quantization="8bit")).load_in_8bit
    assert adapters.quantization_config(ModelConfig(name="m")) is None


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_lora_dropout_on_a_cpu_keeps_each_element_with_1_minus_p_and_scales_the_survivors(p: float) -> None:
    from hpsearch.trainer.dropout import MaskDropout

    drop = MaskDropout(p)
    x = torch.ones(64, 128, 96, requires_grad=True)
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.005
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert abs(y.mean().item() - 1.0) < 0.01  # inverted dropout: the expectation is the input
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.detach())  # the gradient is masked and scaled alike
    # Rows are independent: no two neighbouring 16-bit chunks of one draw share their fate.
    flat = kept.flatten().float()
    assert abs((flat[0::4] * flat[1::4]).mean().item() - (1 - p) ** 2) < 0.005
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # seeded like every other draw of the trial
    assert torch.equal(drop.eval()(x), x)
    half = drop.train()(torch.ones(4096, dtype=torch.bfloat16))
    assert set(half.unique().tolist()) <= {0.0, torch.tensor(1 / (1 - p), dtype=torch.bfloat16).item()}


def test_a_lora_model_draws_its_dropout_masks_with_the_cheaper_dropout(tiny_model: Path) -> None:
    from hpsearch.trainer.adapters import attach
    from hpsearch.trainer.config import AdapterConfig
    from hpsearch.trainer.dropout import MaskDropout

    cache = PretrainedCache()
    base = cache._base(str(tiny_model), 2, torch.float32)
    model = attach(base, AdapterConfig(method="lora", r=4, alpha=8, dropout=0.1), "classification", 0)
    drops = [m for m in model.modules() if isinstance(m, MaskDropout)]
    assert drops and all(d.p == pytest.approx(0.1, abs=1e-5) for d in drops)
    assert not any(type(m) is torch.nn.Dropout for n, m in model.named_modules() if "lora_dropout" in n)
