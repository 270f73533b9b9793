"""Issue 4: the trainer's speed features do what they claim (speed itself is in benchmarks/).

Tokenise once (cache reused, one tokeniser under concurrent first use), no wasted padding
(length-grouped batches, switchable), honest throughput figures (real tokens, MFU maths),
cheap trial start (a memory-mapped read per trial, the previous trial freed first), torch.compile wired, fused AdamW.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hpsearch.search.workers.trial_attrs import NullReporter
from hpsearch.trainer import packing
from hpsearch.trainer.batching import micro_batches
from hpsearch.trainer.config import DataConfig, TrainConfig
from hpsearch.trainer.encoding import prepare
from hpsearch.trainer.loop import COMPILE_BACKEND_ENV, Run, fit, flops_per_token
from hpsearch.trainer.model import PretrainedCache, load_tokenizer
from hpsearch.trainer.optim import build_optimizer
from hpsearch.trainer.report import measured
from hpsearch.trainer.stats import PEAK_ENV, Throughput, mfu, peak_tflops
from tests.support.tiny import tiny_run

WORDS = ["good", "bad", "great", "terrible", "fine"]


def _varied_split(path: Path, n: int, seed: int) -> Path:
    """Texts of 1 to 24 words (a long tail, like SST-2), label = majority of good/bad words."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            k = min(24, max(1, int(rng.expovariate(1 / 6))))
            words = [rng.choice(WORDS) for _ in range(k)]
            label = "positive" if words.count("good") + words.count("great") >= k / 2 else "negative"
            f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
    return path


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    root = tmp_path_factory.mktemp("varied")
    return DataConfig(
        train=str(_varied_split(root / "train.jsonl", 256, 1)),
        validation=str(_varied_split(root / "dev.jsonl", 64, 2)),
    )


def _run(tiny_model: Path, data_cfg: DataConfig, out: Path, **train: object) -> tuple[Run, NullReporter]:
    tokenizer = load_tokenizer(str(tiny_model))
    data = prepare(data_cfg, tokenizer, 32, None)
    cfg = TrainConfig(
        **{
            "learning_rate": 1e-3,
            "batch_size": 32,
            "micro_batch_size": 16,
            "epochs": 1,
            "eval_every": 1000,
            "precision": "fp32",
            **train,
        }
    )
    return tiny_run(tiny_model, (tokenizer, data), cfg, out), NullReporter()


# -- tokenise once ------------------------------------------------------------------------

PREPARE_CHILD = textwrap.dedent("""
    import hashlib, json, sys, time
    from pathlib import Path
    from hpsearch.trainer.config import DataConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.model import load_tokenizer

    model, train, dev, cache, go = sys.argv[1:6]

    class SlowCounting:
        # Wraps the real tokenizer: counts calls and widens the race window.
        def __init__(self, inner):
            self.inner, self.calls = inner, 0
        def __call__(self, *args, **kwargs):
            self.calls += 1
            time.sleep(1.0)
            return self.inner(*args, **kwargs)
        def __getattr__(self, name):
            return getattr(self.inner, name)

    tok = SlowCounting(load_tokenizer(model))
    Path(go + "." + sys.argv[6]).touch()  # ready
    while not Path(go).exists():
        time.sleep(0.01)
    data = prepare(DataConfig(train=train, validation=dev), tok, 32, Path(cache))
    ids = [list(data.train.input_ids), list(data.validation.input_ids)]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    print(json.dumps({"calls": tok.calls, "digest": digest}))
""")


def test_token_cache_is_tokenised_once_under_concurrent_first_use(
    tmp_path: Path, tiny_model: Path, varied: DataConfig
) -> None:
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                PREPARE_CHILD,
                str(tiny_model),
                varied.train,
                varied.validation,
                str(cache),
                str(go),
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "children did not start"
        time.sleep(0.05)
    go.touch()  # both start prepare() at the same moment
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    # One process tokenised (train + validation = 2 calls); the other waited and read its file.
    assert sorted(o["calls"] for o in outs) == [0, 2]
    assert outs[0]["digest"] == outs[1]["digest"]
    assert len(list(cache.glob("tokens-*/meta.json"))) == 1
    assert not list(cache.glob(".tokens-*")), "a temporary file was left behind"


def test_token_cache_is_reused_and_keyed_by_contents_and_max_length(
    tmp_path: Path, tiny_model: Path, varied: DataConfig
) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    calls = 0

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return tokenizer(*args, **kwargs)

    class Counting:
        backend_tokenizer = tokenizer.backend_tokenizer
        pad_token_id = tokenizer.pad_token_id
        __call__ = staticmethod(counting)

    train = tmp_path / "train.jsonl"
    shutil.copy(varied.train, train)
    cfg = DataConfig(train=str(train), validation=varied.validation)
    cache = tmp_path / "cache"
    first = prepare(cfg, Counting(), 32, cache)
    assert calls == 2
    again = prepare(cfg, Counting(), 32, cache)
    assert calls == 2, "the second trial tokenised again"
    assert again.train.input_ids == first.train.input_ids
    prepare(cfg, Counting(), 8, cache)  # another max_length: another entry
    assert calls == 4
    with train.open("a") as f:
        f.write(json.dumps({"text": "good good", "label": "positive"}) + "\n")
    changed = prepare(cfg, Counting(), 32, cache)  # same path, new contents: not stale
    assert calls == 6 and len(changed.train) == len(first.train) + 1
    assert len(list(cache.glob("tokens-*/meta.json"))) == 3


# -- no wasted padding --------------------------------------------------------------------


def _lengths(n: int = 4096, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(64, 3 + int(rng.expovariate(1 / 10))) for _ in range(n)]


def _padded(lengths: list[int], batches: list[list[int]]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def test_grouped_batches_pad_far_less_than_dataset_max_and_random_batches() -> None:
    lengths = _lengths()
    real = sum(lengths)
    grouped = micro_batches(lengths, 32, seed=0, epoch=0, group_by_length=True, batch_size=32)
    shuffled = micro_batches(lengths, 32, seed=0, epoch=0, group_by_length=False, batch_size=32)
    dataset_max = len(lengths) * max(lengths)
    assert dataset_max / real > 4  # what padding to the dataset's max would cost
    assert _padded(lengths, shuffled) / real > 2  # random batches: the transformers default
    # Windows of four steps: half the padding of random batches (transformers' 50-batch windows pad less, at a
    # cost in accuracy: docs/decisions.md, "Length grouping within four steps").
    assert _padded(lengths, grouped) < 0.55 * _padded(lengths, shuffled)
    # The same steps cut into smaller micro-batches pad less again: the window is counted in steps, not passes.
    finer = micro_batches(lengths, 16, seed=0, epoch=0, group_by_length=True, batch_size=32)
    assert _padded(lengths, finer) < 0.85 * _padded(lengths, grouped)
    # Every example exactly once per epoch, and batches still random: not one global sort.
    assert sorted(i for b in grouped for i in b) == list(range(len(lengths)))
    widths = [max(lengths[i] for i in b) for b in grouped]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)
    assert grouped != micro_batches(lengths, 32, seed=0, epoch=1, group_by_length=True, batch_size=32)


def test_group_by_length_off_gives_plain_shuffled_batches() -> None:
    lengths = _lengths()
    batches = micro_batches(lengths, 32, seed=3, epoch=0, group_by_length=False, batch_size=32)
    assert batches == micro_batches(lengths, 32, seed=3, epoch=0, group_by_length=False, batch_size=32)  # deterministic
    assert batches != micro_batches(lengths, 32, seed=3, epoch=1, group_by_length=False, batch_size=32)  # reshuffled
    order = [i for b in batches for i in b]
    assert sorted(order) == list(range(len(lengths))) and order != sorted(order)
    assert all(len(b) == 32 for b in batches)
    # Not length-grouped: a batch spans most of the length range, not a narrow band.
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    grouped = micro_batches(lengths, 32, seed=3, epoch=0, group_by_length=True, batch_size=32)
    grouped_spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in grouped) / len(grouped)
    assert spread > 20 and grouped_spread < spread / 2


def test_a_grouped_step_is_not_one_narrow_band_of_lengths() -> None:
    """One micro-batch a step: each step still spans a quarter of a random window's lengths, not a 50th of it,
    so no step is all one-word phrases (whose labels are not the data's)."""
    lengths = _lengths()
    steps = micro_batches(lengths, 32, seed=5, epoch=0, group_by_length=True, batch_size=32)
    narrow = sum(1 for b in steps if max(lengths[i] for i in b) == min(lengths[i] for i in b))
    assert narrow < len(steps) / 4


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, varied: DataConfig) -> dict[bool, Run]:
    """Two real fits of the tiny model: length-grouped (1 epoch) and plain shuffled (2 epochs), each in padded
    micro-batches as on a GPU (a CPU packs them: test_packed_passes_pad_little_in_random_steps)."""
    runs = {}
    for grouped in (True, False):
        out = tmp_path_factory.mktemp(f"fit-{grouped}")
        run, reporter = _run(tiny_model, varied, out, group_by_length=grouped, epochs=1 if grouped else 2)
        run.started = time.perf_counter() - 5.0  # the trial began 5 s before fit (model copy, say)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(packing, "packs", lambda *_: False)
            result = fit(run, reporter)
        assert result.status == "complete"
        run.meta["attrs"] = reporter.attrs
        run.meta["result_attrs"] = result.attrs
        runs[grouped] = run
    return runs


def test_group_by_length_switch_reaches_the_loop(fitted: dict[bool, Run], tiny_model: Path, varied: DataConfig) -> None:
    from hpsearch.search.study.spec import StudySpec

    spec = StudySpec.from_dict(
        {
            "model": {"name": str(tiny_model)},
            "data": {"train": varied.train, "validation": varied.validation},
            "train": {"group_by_length": False},
        }
    )
    assert spec.train.group_by_length is False
    assert TrainConfig().group_by_length is True  # on by default
    grouped, shuffled = (fitted[g].meta["attrs"]["train_padding_ratio"] for g in (True, False))
    assert grouped < shuffled - 0.2


def test_packed_passes_pad_little_in_random_steps(
    fitted: dict[bool, Run], tmp_path: Path, tiny_model: Path, varied: DataConfig
) -> None:
    """On a CPU a BERT step's rows are packed (trainer/packing.py): random steps pad less than length-grouped
    padded micro-batches, and the figures count the packed sequences' slots."""
    run, reporter = _run(tiny_model, varied, tmp_path, group_by_length=False, epochs=1)
    assert fit(run, reporter).status == "complete"
    packed = reporter.attrs["train_padding_ratio"]
    assert (
        1.0
        <= packed
        < fitted[True].meta["attrs"]["train_padding_ratio"]
        < fitted[False].meta["attrs"]["train_padding_ratio"]
    )
    assert reporter.attrs["train_tokens"] == sum(run.data.train.lengths)


# -- honest figures -----------------------------------------------------------------------


def test_throughput_counts_real_tokens_not_padding(fitted: dict[bool, Run]) -> None:
    run = fitted[False]
    attrs = run.meta["attrs"]
    real = sum(run.data.train.lengths)
    assert attrs["train_samples"] == 2 * len(run.data.train)
    assert attrs["train_tokens"] == 2 * real
    assert attrs["train_padding_ratio"] > 1.2  # random batches of varied lengths do pad
    tokens_per_s = attrs["train_tokens"] / attrs["train_seconds"]
    assert attrs["train_tokens_per_second"] == pytest.approx(tokens_per_s, rel=0.02)
    assert attrs["train_samples_per_second"] == pytest.approx(attrs["train_samples"] / attrs["train_seconds"], rel=0.02)
    assert "mfu" not in attrs  # CPU: no peak rate to compare against
    assert run.meta["result_attrs"] == {k: attrs[k] for k in run.meta["result_attrs"]}


def test_first_step_seconds_counts_from_the_trial_start(fitted: dict[bool, Run]) -> None:
    attrs = fitted[True].meta["attrs"]
    assert 5.0 <= attrs["first_step_seconds"] < 5.0 + attrs["train_seconds"]


def test_mfu_arithmetic_and_peak_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA GeForce RTX 4090 D") == 147.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") == 165.2
    assert peak_tflops("NVIDIA A10G") == 70.0
    assert peak_tflops("Some Future GPU") is None
    monkeypatch.setenv(PEAK_ENV, "500")
    assert peak_tflops("Some Future GPU") == 500.0
    # 6 x 100M params x 1,000 tokens/s = 0.6 PFLOP/s... of a 1 PFLOP/s chip: 60 %.
    assert mfu(6 * 100e6, 1000 * 10, 10.0, 1e15) == pytest.approx(6e-4)
    assert mfu(6 * 100e6, 1_000_000, 1.0, 1e15) == pytest.approx(0.6)


def test_flops_per_token_leaves_embedding_tables_out(tiny_model: Path) -> None:
    model = PretrainedCache().fresh(str(tiny_model), 2, {0: "a", 1: "b"}, 0)
    total = sum(p.numel() for p in model.parameters())
    emb = model.bert.embeddings
    tables = sum(m.weight.numel() for m in (emb.word_embeddings, emb.position_embeddings, emb.token_type_embeddings))
    assert flops_per_token(model) == 6 * (total - tables)
    speed = Throughput(torch.device("cpu"), flops_per_token=flops_per_token(model))
    speed.add(examples=2, tokens=10, padded=16)
    assert measured(speed.speed())["train_padding_ratio"] == 1.6


def test_flops_per_token_counts_a_4bit_weight_as_its_whole_matrix() -> None:
    # bitsandbytes' Params4bit: a (n*m/2, 1) uint8 tensor, the matrix's shape in quant_state.
    class QuantState:
        shape = torch.Size([64, 32])

    model = torch.nn.Linear(32, 64, bias=False)
    packed = torch.nn.Parameter(torch.zeros(64 * 32 // 2, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = QuantState()  # type: ignore[attr-defined]
    model.weight = packed
    assert flops_per_token(model) == 4 * 64 * 32


# -- cheap trial start --------------------------------------------------------------------


def test_each_full_fine_tune_reads_a_pristine_model_and_training_it_leaves_the_file_alone(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A full fine-tune's model is read from its checkpoint per trial, no pristine copy kept (issue 60: the copy was
    a second model in memory); its weights are mapped from the file, and training them must not write through."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    weights = folder / "model.safetensors"
    before = weights.read_bytes()
    cache = PretrainedCache()
    first = cache.fresh(str(folder), 2, {0: "neg", 1: "pos"}, seed=1)
    assert not cache._models, "a full fine-tune's model is not kept between trials"
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)  # a trial trains its model
    assert weights.read_bytes() == before, "training wrote into the checkpoint file"
    second = cache.fresh(str(folder), 2, {0: "neg", 1: "pos"}, seed=1)
    third = cache.fresh(str(folder), 2, {0: "neg", 1: "pos"}, seed=2)
    from transformers import AutoModelForSequenceClassification

    pristine = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2).state_dict()
    body = [k for k in pristine if not k.startswith("classifier.")]
    assert all(torch.equal(second.state_dict()[k], pristine[k]) for k in body), "training leaked into a later trial"
    assert torch.equal(
        second.classifier.weight,
        cache.fresh(str(folder), 2, {0: "neg", 1: "pos"}, 1).classifier.weight,
    )
    assert not torch.equal(second.classifier.weight, third.classifier.weight)  # head drawn from the seed


def test_the_previous_trials_model_is_freed_before_the_next_one_is_made(tiny_model: Path) -> None:
    """A finished trial's model (and its optimizer, gradients) sits in reference cycles: the next trial's model is
    made only after they are collected, not whenever the collector would have run (issue 60)."""
    import gc
    import weakref

    from hpsearch.trainer.labels import LabelMap

    cache, labels = PretrainedCache(), LabelMap.fit(["neg", "pos"], Path("labels"))
    gc.disable()  # the collector must not run by itself here: only trial_model's own collection counts
    try:
        model = cache.trial_model(str(tiny_model), labels, 0)
        holder: dict[str, object] = {"model": model}
        holder["self"] = holder  # a cycle, as the loop and its reporter make
        gone = weakref.ref(model)
        del model, holder
        assert gone() is not None, "the cycle keeps it alive without a collection"
        cache.trial_model(str(tiny_model), labels, 1)
        assert gone() is None, "the previous trial's model was still alive when the next was made"
    finally:
        gc.enable()


def test_a_sharded_trial_takes_the_cached_weights_without_a_copy(tiny_gpt2: Path) -> None:
    """Rank 0 of a sharded trial (``private``) holds the model once while it sends the shards: the trial gets the
    cached model itself, the cache gives it up, and the next trial reads it from disk, pristine."""
    from transformers import AutoModelForCausalLM

    cache, name = PretrainedCache(), str(tiny_gpt2)
    kept = cache._base(name, 0, torch.float32)  # warm, as after a worker's first trial
    taken = cache.trial_model(name, None, 0, private=True)
    assert taken is kept, "a sharded trial takes the cached model itself, no copy"
    with torch.no_grad():
        for p in taken.parameters():
            p.add_(1.0)  # sharding and training change it
    again = cache.trial_model(name, None, 0, private=True)
    pristine = AutoModelForCausalLM.from_pretrained(tiny_gpt2).state_dict()
    assert again is not taken and all(torch.equal(v, pristine[k]) for k, v in again.state_dict().items())
    assert cache.fresh_causal_lm(name) is not cache._base(name, 0, torch.float32), "other trials still get a copy"


# -- kernels ------------------------------------------------------------------------------


def test_fused_adamw_on_cpu() -> None:
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    assert opt.defaults["fused"] is True


def test_compile_switch_compiles_and_saves_a_plain_checkpoint(
    tmp_path: Path, tiny_model: Path, varied: DataConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo

    # Dynamo traces the model for real; the "eager" backend skips inductor's C++ build, which
    # takes minutes on a small CPU (the benchmark and GPU runs use inductor).
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")
    torch._dynamo.reset()
    run, reporter = _run(tiny_model, varied, tmp_path, compile=True, max_steps=1)
    result = fit(run, reporter)
    from torch._dynamo.utils import counters

    assert result.status == "complete" and reporter.attrs["compiled"] is True
    assert counters["stats"]["unique_graphs"] >= 1, "torch.compile never ran"
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "best" / "model.safetensors")).keys()
    assert keys and not any("_orig_mod" in k for k in keys)
