"""The fp32 attention on a CPU under bf16 autocast (trainer/attention.py) computes what transformers' SDPA does."""

from __future__ import annotations

from pathlib import Path

import torch

from hpsearch.trainer import attention
from hpsearch.trainer.model import PretrainedCache

CPU = torch.device("cpu")


def test_padding_is_masked_under_the_fp32_attention_as_under_sdpa(tiny_model: Path) -> None:
    """A padded row's real tokens come out as the same row's unpadded: its padding is masked out (a name that
    transformers' mask interface does not know got no mask at all, and every row attended to its padding)."""
    model = PretrainedCache().fresh(str(tiny_model), 2, {0: "negative", 1: "positive"}, 0).eval()
    attention.use_fast_attention(model, CPU, "bf16")
    assert model.config._attn_implementation == attention.NAME
    ids = torch.tensor([[2, 11, 12, 13, 14, 3] + [0] * 10])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        padded = model.bert(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state[:, :6]
        alone = model.bert(input_ids=ids[:, :6]).last_hidden_state
    torch.testing.assert_close(padded.float(), alone.float(), rtol=0, atol=1e-5)
