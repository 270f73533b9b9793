"""A column of a tokenised split read from the token cache's Arrow files through a memory map: rows come out as
Python lists (or numbers) one at a time, when a batch is built, so a worker holds none of the file's token ids in
its own memory; the mapped pages are the host's page cache, shared by every worker reading the same file."""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


class Mapped(Sequence[Any]):
    """One column of a split: a list column (``input_ids``, ``token_labels``...) gives a list of numbers a row, a
    scalar column (``labels``, ``prompt_lengths``) a number. Numpy views of the Arrow buffers (no copy), per record
    batch the file was written in."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        import pyarrow as pa

        self.nested = pa.types.is_list(column.type)
        self._offsets: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._starts = [0]
        for chunk in column.chunks:
            if self.nested:
                self._offsets.append(chunk.offsets.to_numpy(zero_copy_only=True))
                self._values.append(chunk.values.to_numpy(zero_copy_only=True))
            else:
                self._values.append(chunk.to_numpy(zero_copy_only=True))
            self._starts.append(self._starts[-1] + len(chunk))

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        c = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[c]
        if self.nested:
            offsets = self._offsets[c]
            return self._values[c][offsets[j] : offsets[j + 1]].tolist()
        return self._values[c][j].item()

    def __iter__(self) -> Iterator[Any]:
        for c, values in enumerate(self._values):
            if self.nested:
                offsets = self._offsets[c]
                for j in range(len(offsets) - 1):
                    yield values[offsets[j] : offsets[j + 1]].tolist()
            else:
                yield from values.tolist()

    def __eq__(self, other: object) -> bool:
        """Row by row, against another column or a list of rows (what a test compares with)."""
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def row_lengths(self) -> array[int]:
        """Each row's length (a list column): 4 bytes a row, computed from the offsets alone."""
        import numpy as np

        out: array[int] = array("i")
        for offsets in self._offsets:
            out.frombytes(np.diff(offsets).astype(np.int32).tobytes())
        return out

    def counts_not(self, value: int, start: int) -> array[int]:
        """Per row of a list column, how many entries from position ``start`` on differ from ``value``."""
        import numpy as np

        out: array[int] = array("i")
        for offsets, values in zip(self._offsets, self._values, strict=True):
            keep = np.concatenate([[0], np.cumsum(values != value)])
            first = np.minimum(offsets[:-1] + start, offsets[1:])  # a row shorter than ``start`` counts nothing
            out.frombytes((keep[offsets[1:]] - keep[first]).astype(np.int32).tobytes())
        return out
