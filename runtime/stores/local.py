"""``local://[name]``: an in-process store (tests, the single-process demo, same-process workers).

Stores with the same name in one process share one space (a process-level registry), so an
encode worker and a prefill worker running in one process hand embeddings over by reference:
``put`` keeps the tensor itself (detached, not copied) and ``get`` returns it. Callers must treat
stored tensors as read-only.

Waiters park on futures registered per key; ``put`` resolves them. Futures are completed on their
own event loop (``call_soon_threadsafe`` when another loop puts), so one space can serve several
loops, e.g. pytest's per-test loops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runtime.redis.waiters import KeyedWaiters, wait_present
from runtime.stores.base import EmbeddingStore, expiry_ms
from runtime.stores.errors import StoreKeyMissing, StoreTimeout
from schemas import tensor_ops

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class _Space:
    """One named namespace: values, expiries and the futures waiting on keys."""

    values: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    waiters: KeyedWaiters[str] = field(default_factory=lambda: KeyedWaiters(threadsafe=True))
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_sweep: float = 0.0


_SPACES: dict[str, _Space] = {}
_SPACES_LOCK = threading.Lock()
_SWEEP_INTERVAL_S = 1.0


def _space(name: str) -> _Space:
    with _SPACES_LOCK:
        return _SPACES.setdefault(name, _Space())


def _live(entry: tuple[torch.Tensor, int] | None, now_ms: int) -> bool:
    return entry is not None and (entry[1] == 0 or entry[1] > now_ms)


class LocalStore(EmbeddingStore):
    """In-process store; see the module docstring."""

    def __init__(self, url: str = "local://") -> None:
        parts = urlsplit(url)
        if parts.scheme != "local":
            raise ValueError(f"not a local:// URL: {url!r}")
        self._name = (parts.netloc + parts.path).strip("/") or "default"
        self._url = f"local://{self._name}"
        self._space = _space(self._name)
        self.wake_checks = 0
        """How many times ``wait`` re-examined its keys (tests use it to prove it does not spin)."""

    @property
    def url(self) -> str:
        return self._url

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        exp = expiry_ms(ttl_s)
        sp = self._space
        with sp.lock:
            # A wire tensor (the render router's) is kept as it is: torch only where it is read.
            sp.values[key] = (tensor_ops.detached(tensor), exp)
            self._maybe_sweep(sp)
        sp.waiters.wake(key)  # after the value is in: a waiter that looks now finds it

    def _maybe_sweep(self, sp: _Space) -> None:
        """Drop expired entries at most once a second (caller holds the lock)."""
        now = time.monotonic()
        if now < sp.next_sweep:
            return
        sp.next_sweep = now + _SWEEP_INTERVAL_S
        now_ms = int(time.time() * 1000)
        for k in [k for k, e in sp.values.items() if not _live(e, now_ms)]:
            del sp.values[k]

    def _lookup(self, key: str) -> torch.Tensor | None:
        sp = self._space
        now_ms = int(time.time() * 1000)
        with sp.lock:
            entry = sp.values.get(key)
            if entry is None:
                return None
            if not _live(entry, now_ms):
                del sp.values[key]
                return None
            return entry[0]

    async def get(self, key: str) -> torch.Tensor:
        t = self._lookup(key)
        if t is None:
            raise StoreKeyMissing(key)
        return tensor_ops.to_torch(t)

    async def exists(self, key: str) -> bool:
        return self._lookup(key) is not None

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        exp = expiry_ms(ttl_s)
        sp = self._space
        with sp.lock:
            entry = sp.values.get(key)
            if not _live(entry, int(time.time() * 1000)):
                sp.values.pop(key, None)
                return False
            assert entry is not None
            sp.values[key] = (entry[0], exp)
            return True

    async def delete(self, key: str) -> None:
        with self._space.lock:
            self._space.values.pop(key, None)

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        async def missing(pending: list[str]) -> list[str]:
            self.wake_checks += 1
            return [k for k in pending if self._lookup(k) is None]

        await wait_present(
            self._space.waiters,
            keys,
            timeout_s,
            missing=missing,
            timed_out=lambda left: StoreTimeout(left, timeout_s),
        )

    async def close(self) -> None:
        """Nothing to release: the space outlives the handle (other handles may share it)."""
