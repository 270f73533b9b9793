"""The task names every trainer module speaks of, and the label a token left out of the loss carries. A module of
its own: the data types (tokenised.py), the label map (labels.py) and the batching all need them, and none of those
may import another just for a name."""

from __future__ import annotations

CLASSIFICATION, CAUSAL_LM = "classification", "causal-lm"
REGRESSION, MULTI_LABEL, TOKEN_CLASSIFICATION = "regression", "multi-label", "token-classification"
PER_EXAMPLE = (CLASSIFICATION, REGRESSION, MULTI_LABEL)
"""The tasks with one target a row (a class id, or a row of ``Encoded.scores``): the loss is averaged per row."""
IGNORE_INDEX = -100
"""Label of a token left out of the loss (cross_entropy's ignore_index): prompt and padding."""
