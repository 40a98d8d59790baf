"""Embedding stores chosen by URI: ``redis://``, ``redis+cluster://``, ``shm://``, ``local://``,
``cuda://``.

``open_store(url)`` returns a fresh handle the caller owns (``await store.close()`` when done, or
``async with open_store(url) as store``); the interface every backend implements is
:class:`runtime.stores.base.EmbeddingStore`.

Importing this package (for the errors: :mod:`runtime.stores.errors`) imports no torch; a
backend, which parks tensors, is imported when a store is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runtime.stores.errors import (
    StoreCorrupt,
    StoreError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
)
from schemas.defaults import STORE_SCHEMES

if TYPE_CHECKING:
    from runtime.stores.base import EmbeddingStore

SUPPORTED_SCHEMES = STORE_SCHEMES


def open_store(url: str) -> EmbeddingStore:
    """A new store handle for ``url``.

    Raises ValueError for an unknown scheme, and StoreError for ``cuda://`` without CUDA.
    """
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss"):
        from runtime.stores.redis import RedisStore

        return RedisStore(url)
    if scheme == "redis+cluster":
        from runtime.stores.redis_cluster import RedisClusterStore

        return RedisClusterStore(url)
    if scheme == "shm":
        from runtime.stores.shm import ShmStore

        return ShmStore(url)
    if scheme == "local":
        from runtime.stores.local import LocalStore

        return LocalStore(url)
    if scheme == "cuda":
        from runtime.stores.cuda import CudaStore

        return CudaStore(url)
    raise ValueError(
        f"unknown embedding store scheme {scheme!r} in {url!r}; supported: "
        + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    )


__all__ = [
    "SUPPORTED_SCHEMES",
    "StoreCorrupt",
    "StoreError",
    "StoreKeyMissing",
    "StoreTimeout",
    "StoreUnavailable",
    "open_store",
]
