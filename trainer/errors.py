"""Errors of the trainer that the CLI reports as bad input (kept free of heavy imports)."""

from __future__ import annotations


class ModelError(ValueError):
    """The model or its tokenizer cannot be loaded; the message says why and what to do."""
