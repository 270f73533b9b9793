"""Money: a study's device time at the spec's price per device hour, in its currency. Device time is the ledger's
(storage/ledger.py); every money figure `status`, `best`, the summary and the money budget show is ``Price.of``
of it, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from hpsearch.search.study.search_config import SearchConfig


@dataclass(frozen=True)
class Price:
    per_hour: float  # of one device: a trial on a "cuda:0+1" group is billed its ledger time, which counts both
    currency: str

    @classmethod
    def of_search(cls, search: SearchConfig) -> Price | None:
        """The spec's price, or None where it gives none (no money is shown)."""
        return cls(search.price_per_gpu_hour, search.currency) if search.price_per_gpu_hour > 0 else None

    def of(self, device_seconds: float) -> float:
        """What ``device_seconds`` of device time cost: device hours x the price."""
        return device_seconds / 3600 * self.per_hour

    @staticmethod
    def number(amount: float) -> str:
        """An amount as it is shown: cents once it is worth them, four digits below one unit (a CPU test costs
        fractions of a cent)."""
        return f"{amount:,.2f}" if amount >= 1 else f"{amount:.4g}"

    def text(self, amount: float) -> str:
        return f"{self.number(amount)} {self.currency}".rstrip()
