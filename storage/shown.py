"""Text read from a database (a study or parameter name, a stored value) as it may be printed: one line, no
terminal escape sequences, bounded. A row is input: a newline in it would forge a log line, an escape sequence would
reach the terminal, and a megabyte of it would bury the line it is in."""

from __future__ import annotations

LIMIT = 80
"""Characters of one value shown: enough for any name a person types, short enough that the line stays a line."""


def shown(value: object, limit: int = LIMIT) -> str:
    """``value`` (str() of a non-string) with every character that is not printable written as Python writes it in a
    string literal (``\\n``, ``\\x1b``, ``\\u202e``), cut to ``limit`` characters with "..." (and how long it was)."""
    text = value if isinstance(value, str) else str(value)
    cut = text[: limit + 1]  # escaping a character never shortens it: no more of a long text is needed
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    if len(escaped) <= limit and len(cut) == len(text):
        return escaped
    return f"{escaped[: max(limit - 3, 0)]}... ({len(text):,} characters)"
