"""The embedding stores' typed errors, apart from the stores themselves.

Every store raises these, and the consume loop's retry policy tells a store that cannot be
reached (retried for a time budget) from one that timed out waiting by them. They subclass the
standard errors (``StoreTimeout(TimeoutError)``) so callers that know nothing of stores still
catch them. Kept free of torch: the retry policy runs in every consumer, the results collector
included, which holds no tensor.
"""

from __future__ import annotations

from collections.abc import Sequence


class StoreError(Exception):
    """Base class of every embedding-store error."""


class StoreKeyMissing(StoreError, KeyError):
    """A key (or several) is absent or expired. ``keys`` lists the missing ones."""

    def __init__(self, keys: str | Sequence[str]) -> None:
        self.keys: list[str] = [keys] if isinstance(keys, str) else list(keys)
        self.key = self.keys[0] if self.keys else ""
        super().__init__(f"missing from the store: {', '.join(self.keys)}")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class StoreTimeout(StoreError, TimeoutError):
    """``wait`` ran out of time. ``missing`` names the keys that never became ready."""

    def __init__(self, missing: Sequence[str], timeout_s: float) -> None:
        self.missing = list(missing)
        self.timeout_s = timeout_s
        super().__init__(
            f"timed out after {timeout_s:g}s waiting for {len(self.missing)} key(s): "
            f"{', '.join(self.missing)}"
        )


class StoreUnavailable(StoreError, ConnectionError):
    """The backend cannot be reached right now (transient: the consume loop retries it)."""


class StoreCorrupt(StoreError, ValueError):
    """A stored value does not follow the blob layout (foreign writer, truncated file)."""
