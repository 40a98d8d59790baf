"""The processor's outputs of encoded images, by the blake3 of the file's bytes.

An image sent again (the same photo in every turn of a conversation, a product picture many
users ask about) would be decoded in a child process, converted, resized, normalised and
patched again to the same ``pixel_values`` and grid. Like vLLM's multimodal processor cache,
the renderer keeps the outputs of images it processed, keyed by a digest of the encoded bytes,
and takes them from here instead: same bytes, same decoder, same limits, same processor, so
the same tensors (the renderer's limits and processor are fixed for its life, and only images
that rendered are kept). Bounded by bytes (``EPD_RENDER_CACHE_BYTES``), least recently used
first out; 0 turns it off.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import blake3
import torch
from PIL import Image


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image's processor outputs, ready for its placeholder."""

    pixel_values: torch.Tensor
    grid: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The bytes the cache charges for it."""
        return self.pixel_values.nbytes + self.grid.nbytes


@dataclass(frozen=True, slots=True)
class KeyedImage:
    """A decoded image and the digest of the bytes it came from (to keep its outputs under)."""

    image: Image.Image
    key: bytes


def image_key(data: bytes | bytearray | memoryview) -> bytes:
    """The cache key of an encoded image: blake3 of its bytes."""
    return blake3.blake3(data).digest()


class ProcessedImages:
    """A least-recently-used map from :func:`image_key` to :class:`ProcessedImage`, bounded by
    bytes; safe to use from the event loop and the render threads at once."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._items: OrderedDict[bytes, tuple[ProcessedImage, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        """False when the bound is 0."""
        return self.max_bytes > 0

    def get(self, key: bytes) -> ProcessedImage | None:
        """The outputs kept under ``key``, or None. Outputs changed in place since they were
        kept (their version counter moved) are dropped, never handed out."""
        with self._lock:
            found = self._items.get(key)
            if found is not None and found[0].pixel_values._version != found[1]:
                self._drop(key)
                found = None
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, key: bytes, item: ProcessedImage) -> None:
        """Keep ``item`` under ``key`` (not when it alone is over the bound), evicting the
        least recently used until the bound holds."""
        size = item.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._drop(key)
            self._items[key] = (item, item.pixel_values._version)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, key: bytes) -> None:
        item, _ = self._items.pop(key)
        self._bytes -= item.nbytes

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes
