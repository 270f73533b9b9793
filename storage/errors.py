"""Errors raised by the storage layer: every driver error that escapes ``storage/`` is wrapped into one of these."""

from __future__ import annotations


class StorageError(Exception):
    """A storage operation failed; the message says what and how to fix it."""


class StorageUrlError(StorageError):
    """The storage URL is malformed, points nowhere, or is refused (bad user input)."""


class StudyNotFoundError(StorageError):
    """The named study does not exist in the storage."""


class StudyFolderError(StorageError):
    """A study's checkpoint folder belongs to another study of the same name (bad user input)."""
