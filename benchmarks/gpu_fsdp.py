"""The FSDP part of the GPU check (issue 40): what one GPU can check of sharded trials.

    python benchmarks/gpu_fsdp.py          (run by gpu_check.sh, after gpu_check.py)
    python benchmarks/gpu_fsdp.py --cpu    (the script itself, on a CPU over gloo: a dry run before a lease)

1. The sharded path on one rank over NCCL: a GPT-2 (12 layers, 768 wide) trained by ``fit`` with
   ``sharding = "fsdp"`` in bf16 on cuda:0 (a process group of one: fully_shard, the sharded grad path, the
   consolidated best model, the sharded resumable state all run on the GPU), then resumed from its sharded
   state; the best model loaded with ``from_pretrained`` reproduces its validation loss.
2. The memory plan against the measured peak of that run (torch.cuda.max_memory_allocated).
3. ``hpsearch plan`` of a Llama-3-8B full fine-tune (config built here, no download) against this GPU's memory
   (read through nvidia-smi), with and without sharding: fp32 masters, ~16 bytes a parameter (145 GiB: refused
   on one H100 or H200), and ``precision = "bf16-true"`` (10 bytes a parameter).
4. Planned against measured peak for a 0.5B checkpoint stored in bf16 (a Qwen2-0.5B-shaped Llama built here from
   random weights): one full fine-tune each in the mixed default and in bf16-true, on cuda:0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpsearch.search.presets import tiny_gpt2
    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer import distributed, memory, meta_model
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.config import DataConfig, TrainConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.evaluate import evaluate
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache, load_tokenizer

    work = Path(tempfile.mkdtemp())
    cpu = "--cpu" in sys.argv
    device = torch.device("cpu" if cpu else "cuda:0")
    size = {"layers": 2, "hidden": 64, "heads": 4} if cpu else {"layers": 12, "hidden": 768, "heads": 12}
    model_dir = str(tiny_gpt2.build(work / "gpt2", dropout=0.0, **size))
    steps = (4, 6, 2) if cpu else (20, 30, 10)  # first run, resumed run, validation interval
    for name, n, seed in (("train", 1024, 1), ("dev", 128, 2)):
        rows = "".join(json.dumps({"text": t}) + "\n" for t in tiny_gpt2.texts(n, seed))
        (work / f"{name}.jsonl").write_text(rows)
    store = distributed.main_store(1)
    world = distributed.join(0, 1, store.port, device, store=store)
    tokenizer = load_tokenizer(model_dir)
    data = prepare(DataConfig(str(work / "train.jsonl"), str(work / "dev.jsonl")), tokenizer, 64, None, "causal-lm")
    cfg = TrainConfig(learning_rate=5e-4, batch_size=32, micro_batch_size=8, max_steps=steps[0], eval_every=steps[2])
    cfg = replace(cfg, precision="bf16", sharding="fsdp", devices_per_trial=2, resume_every_minutes=0)
    files = RunFiles(work / "out/best", work / "out/resume/state.pt", work / "out/tb", work / "out/resume/oom.json")
    failures = []

    def run(resume: Path | None, steps: int) -> object:
        model = PretrainedCache().fresh_causal_lm(model_dir)
        r = Run(model, tokenizer, data, replace(cfg, max_steps=steps), "loss", device, files, resume, world=world)
        return fit(r, NullReporter())

    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    first = run(None, steps[0])
    peak = 1 if cpu else torch.cuda.max_memory_allocated()
    print(f"1. fsdp on one GPU: {first.status} at step {first.steps}, best {first.best_value:.4f}")
    resumed = run(files.state, steps[1])
    says = f"resumed: {resumed.status} at step {resumed.steps} from the sharded state at step {steps[2]}"
    print(says)
    if resumed.steps != steps[1] or not (files.state.parent / "shards").exists():
        failures.append(says)
    best = AutoModelForCausalLM.from_pretrained(files.best).to(device)
    meta = json.loads((files.best / "hpsearch.json").read_text())
    loss = evaluate(best, data.validation, pad_id=data.pad_id, batch_size=16, device=device, precision="bf16").loss
    print(f"   best model: from_pretrained validation loss {loss:.4f}, saved at {meta['val_loss']:.4f}")
    if abs(loss - meta["val_loss"]) > 0.02 * meta["val_loss"]:
        failures.append(f"the best model's loss {loss:.4f} is not its saved {meta['val_loss']:.4f}")
    world.close()

    m, shape = meta_model.meta_model(model_dir, "causal-lm")
    e = memory.estimate(m, shape, memory.Setup("bf16", 8, 64, sharding="fsdp", devices=1))
    print(
        f"2. plan {e.total / 2**20:.0f} MiB (weights {e.weights / 2**20:.0f}, gradients {e.gradients / 2**20:.0f}, "
        f"optimizer {e.optimizer / 2**20:.0f}, gathered {e.gathered / 2**20:.0f}, activations "
        f"{e.activations / 2**20:.0f}) against a measured peak of {peak / 2**20:.0f} MiB: {e.total / peak:.2f}x"
    )

    llama = work / "llama-3-8b"
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
    ).save_pretrained(llama)
    spec = work / "llama.toml"
    spec.write_text(
        f'[model]\nname = "{llama}"\ntask = "causal-lm"\nmax_length = 2048\n'
        '[data]\ntrain = "t.jsonl"\nvalidation = "v.jsonl"\n'
        '[train]\nbatch_size = 8\nmicro_batch_size = 1\nprecision = "bf16"\n'
        '[search]\nmetric = "loss"\n[search.space]\nlearning_rate = { type = "float", low = 1e-5, high = 1e-4 }\n'
    )
    # Against cuda:0's memory as nvidia-smi reports it; the table has the same trial sharded over 2-16 GPUs.
    cmd = [sys.executable, "-m", "hpsearch.search.cli.main", "plan", "--study", "llama", "--config", str(spec)]
    out = subprocess.run([*cmd, "--devices", "cpu:1" if cpu else "0"], capture_output=True, text=True, cwd=work)
    print(
        f"3. Llama-3-8B full fine-tune, plan against this GPU: exit {out.returncode}\n{out.stdout}{out.stderr[-800:]}"
    )
    if "16 bytes a trained parameter" not in out.stdout or 'precision = "bf16-true"' not in out.stdout:
        failures.append("the Llama-3-8B plan does not say fp32 masters (16 bytes a parameter) and bf16-true")
    failures += planned_vs_measured(work, device, tokenizer, cpu)
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


def planned_vs_measured(work: Path, device: object, tokenizer: object, cpu: bool) -> list[str]:
    """4. A 0.5B bf16 checkpoint (Qwen2-0.5B's shape; tiny on --cpu), one full fine-tune per regime: the plan's
    total against torch.cuda.max_memory_allocated (on --cpu, the held bytes the trainer measures)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpsearch.search.workers.trial_attrs import NullReporter
    from hpsearch.trainer import memory, meta_model
    from hpsearch.trainer.checkpoint import RunFiles
    from hpsearch.trainer.config import DataConfig, TrainConfig
    from hpsearch.trainer.encoding import prepare
    from hpsearch.trainer.loop import Run, fit
    from hpsearch.trainer.model import PretrainedCache

    shape = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
        if cpu
        else {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14}
    )
    folder = work / "half-b"
    vocab = len(tokenizer)  # type: ignore[arg-type]
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=2, max_position_embeddings=512, **shape)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    data = prepare(DataConfig(str(work / "train.jsonl"), str(work / "dev.jsonl")), tokenizer, 64, None, "causal-lm")
    failures = []
    for precision in ("bf16", "bf16-true"):
        cfg = TrainConfig(learning_rate=2e-5, batch_size=8, micro_batch_size=8, max_steps=4, eval_every=4)
        cfg = replace(cfg, precision=precision, resume_every_minutes=10**6)  # type: ignore[arg-type]
        out = work / f"half-b-{precision}"
        files = RunFiles(out / "best", out / "resume/state.pt", out / "tb", out / "resume/oom.json")
        trial = PretrainedCache().fresh_causal_lm(str(folder), precision=precision)
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
        result = fit(Run(trial, tokenizer, data, cfg, "loss", device, files), NullReporter())  # type: ignore[arg-type]
        measured = (result.figures.held_mb or 0) * 2**20
        m, s = meta_model.meta_model(str(folder), "causal-lm")
        e = memory.estimate(m, s, memory.Setup("bf16", 8, 64, requested=precision))
        states = e.weights + e.gradients + e.optimizer
        planned = states if cpu else e.total
        print(
            f"4. 0.5B bf16 checkpoint, {e.regime} ({e.bytes_per_trained} bytes a parameter): planned "
            f"{planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB: {planned / max(measured, 1):.2f}x"
        )
        if not 0.8 <= planned / max(measured, 1) <= 1.3:
            failures.append(f"{e.regime}: the plan is {planned / max(measured, 1):.2f}x the measured peak")
        del trial
    return failures


if __name__ == "__main__":
    sys.exit(main())
