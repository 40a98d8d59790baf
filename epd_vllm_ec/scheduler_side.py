"""The scheduler side's decisions, apart from vLLM: which items a consumer trusts and loads,
which requests cannot be served, and the entries a producer hands out.

The trust decision is made here, in the scheduler, before vLLM plans an item as "loaded
externally": once planned, vLLM's model runner has no way back to computing it (a missing
item is a hard ``Encoder cache miss``). So an entry is verified and its key touched (the same
hit rule as our encode worker: a hit extends the value's life, so it cannot expire between the
plan and the load) when the request is first admitted; everything refused is logged with its
reason and either computed locally or, for an item the request carries no media for, the
request is failed (vLLM's ``take_unavailable_requests``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from epd_vllm_ec.entries import Verdict, item_key, signed_entry, verify_entry
from epd_vllm_ec.settings import ConnectorSettings
from epd_vllm_ec.store_thread import StoreThread
from runtime.stores.base import EmbeddingStore
from runtime.stores.errors import StoreError

log = logging.getLogger(__name__)


class Feature(Protocol):
    """What is read of vLLM's ``MultiModalFeatureSpec``."""

    identifier: str
    data: Any


class RequestLike(Protocol):
    """What is read of vLLM's ``Request``."""

    request_id: str
    mm_features: list[Any]
    ec_transfer_params: dict[str, Any] | None


def wall_ms() -> int:
    """Epoch milliseconds (entries' expiries are wall clock)."""
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One item the worker side loads this step: from ``key``, ``rows`` embeddings long."""

    mm_hash: str
    key: str
    rows: int | None


def touch_all(thread: StoreThread, keys: list[str], ttl_s: float, timeout_s: float) -> list[bool]:
    """Touch ``keys`` together (one concurrent batch); which of them are live."""

    async def op(store: EmbeddingStore) -> list[bool]:
        return list(await asyncio.gather(*(store.touch(k, ttl_s) for k in keys)))

    return thread.call(op, timeout_s) if keys else []


class ConsumerGate:
    """A consumer's scheduler-side state: trusted items (mm_hash -> key), the loads planned
    for the next step, and requests that cannot get an item."""

    def __init__(
        self, settings: ConnectorSettings, thread: StoreThread, clock: Callable[[], int] = wall_ms
    ) -> None:
        self.settings = settings
        self.thread = thread
        self.clock = clock
        self._trusted: dict[str, str] = {}
        self._holders: dict[str, set[str]] = {}
        self._judged: dict[str, set[str]] = {}
        self._loads: dict[str, LoadItem] = {}
        self._unavailable: set[str] = set()

    def trusted(self, mm_hash: str) -> bool:
        """Whether a verified entry, whose key was live, stands behind ``mm_hash``."""
        return mm_hash in self._trusted

    def admit(self, request: RequestLike) -> bool:
        """Judge the request's items not judged yet; False when one it cannot do without was
        refused (the request is then reported by :meth:`take_unavailable`)."""
        judged = self._judged.setdefault(request.request_id, set())
        fresh = [f for f in request.mm_features if f.identifier not in judged]
        if not fresh:
            return request.request_id not in self._unavailable
        judged.update(f.identifier for f in fresh)
        verdicts = self._verdicts(request, [f.identifier for f in fresh])
        for feature in fresh:
            verdict = verdicts[feature.identifier]
            if verdict.trusted:
                assert verdict.key is not None
                self._trusted[feature.identifier] = verdict.key
                self._holders.setdefault(feature.identifier, set()).add(request.request_id)
            elif verdict.rule != "no-entry":
                self._refused(request, feature, verdict)
        return request.request_id not in self._unavailable

    def _verdicts(self, request: RequestLike, hashes: list[str]) -> dict[str, Verdict]:
        now = self.clock()
        out = {
            h: verify_entry(request.ec_transfer_params, h, self.settings, self.thread.url, now)
            for h in hashes
        }
        keys = {h: v.key for h, v in out.items() if v.key is not None}
        try:
            live = touch_all(
                self.thread, list(keys.values()), self.settings.ttl_s, self.settings.io_timeout_s
            )
        except (StoreError, OSError) as exc:
            down = Verdict(None, f"the store cannot be read: {exc}", "store")
            return {h: down if v.trusted else v for h, v in out.items()}
        for (h, key), ok in zip(keys.items(), live, strict=True):
            if not ok:
                out[h] = Verdict(None, f"its key {key!r} is not in the store", "missing")
        return out

    def _refused(self, request: RequestLike, feature: Feature, verdict: Verdict) -> None:
        if feature.data is not None:
            log.warning(
                "EC entry refused (%s) for request %s item %s: %s; encoding it locally",
                verdict.rule,
                request.request_id,
                feature.identifier,
                verdict.reason,
            )
            return
        log.error(
            "EC entry refused (%s) for request %s item %s: %s; the request carries no media "
            "to encode it from: failing it",
            verdict.rule,
            request.request_id,
            feature.identifier,
            verdict.reason,
        )
        self._unavailable.add(request.request_id)

    def plan_load(self, mm_hash: str, rows: int | None) -> None:
        """vLLM allocated cache space for ``mm_hash``: load it next step if it is trusted."""
        key = self._trusted.get(mm_hash)
        if key is not None:
            self._loads[mm_hash] = LoadItem(mm_hash, key, rows)

    def take_loads(self) -> list[LoadItem]:
        """The loads planned since the last call (and forget them)."""
        loads = list(self._loads.values())
        self._loads.clear()
        return loads

    def take_unavailable(self) -> set[str]:
        """Requests to fail since the last call (each reported once)."""
        out, self._unavailable = self._unavailable, set()
        return out

    def finished(self, request_id: str) -> None:
        """Forget a finished request; an item no running request holds is trusted no more."""
        for mm_hash in self._judged.pop(request_id, set()):
            holders = self._holders.get(mm_hash)
            if holders is None:
                continue
            holders.discard(request_id)
            if not holders:
                del self._holders[mm_hash]
                self._trusted.pop(mm_hash, None)


def producer_entries(
    settings: ConnectorSettings, thread: StoreThread, hashes: Iterable[str], now_ms: int
) -> dict[str, dict[str, Any]]:
    """Signed entries for the items this producer has in the store, by mm_hash (an item whose
    key is not there, never saved or already expired, gets none). Each key is touched first,
    so the value lives at least as long as its entry says."""
    hashes = list(dict.fromkeys(hashes))
    keys = [item_key(settings, h) for h in hashes]
    live = touch_all(thread, keys, settings.ttl_s, settings.io_timeout_s)
    expires_ms = now_ms + int(settings.ttl_s * 1000)
    return {
        h: signed_entry(settings, thread.url, h, expires_ms)
        for h, ok in zip(hashes, live, strict=True)
        if ok
    }
