"""What the validator enforces: :class:`ValidationConfig`, built from settings or by hand.

Its own module, below the validator and the entry checks that read it (``schemas.ec_entries``,
``schemas.kv_entries``), so none of them imports another in a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import defaults
from schemas.modalities import METADATA_FIELDS, REQUIRED_METADATA
from schemas.types import DTYPE_SIZES
from schemas.types import now_ms as wall_now_ms

Mode = Literal["strict", "vllm"]

# From the one modality-field table (schemas/modalities.py).
DEFAULT_METADATA_FIELDS = METADATA_FIELDS


def _default_required() -> dict[str, tuple[str, ...]]:
    return dict(REQUIRED_METADATA)


@dataclass(frozen=True)
class ValidationConfig:
    """What the validator enforces. ``from_settings`` builds it from ``EPD_*`` settings."""

    mode: Mode = "strict"
    secret: bytes | None = None
    namespace: str = "ec"
    merge_size: int = 2
    metadata_fields: frozenset[str] = DEFAULT_METADATA_FIELDS
    required_metadata: Mapping[str, tuple[str, ...]] = field(default_factory=_default_required)
    max_tensor_bytes: int = defaults.MAX_TENSOR_BYTES
    allowed_dtypes: frozenset[str] = frozenset(DTYPE_SIZES)
    now_ms: Callable[[], int] | None = None
    model_fingerprint: str | None = None
    """When set, entry keys must be exactly ``{namespace}:{model_fingerprint}:{mm_hash}``."""
    store: str | None = None
    """When set, every signed entry must name this store (``EmbeddingStore.url``)."""
    check_values: bool = True
    """Scan floating-point tensors for NaN/Inf. The fan-out turns it off: it never touches the
    pixels, and the encode worker scans them where it reads them anyway."""

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> ValidationConfig:
        """Config from an ``runtime.settings.Settings``; keyword overrides win (CLI flags)."""
        values: dict[str, Any] = {
            "mode": settings.validation_mode,
            "secret": settings.secret_bytes(),
            "namespace": settings.ec_namespace,
            "merge_size": settings.spatial_merge_size,
            "now_ms": wall_now_ms,
        }
        # None: derived from the model's processor by whoever knows it
        # (runtime.processor_limits), passed in as an override; a gate that knows no processor
        # keeps the class default.
        if getattr(settings, "max_tensor_bytes", None) is not None:
            values["max_tensor_bytes"] = settings.max_tensor_bytes
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def for_worker(
        cls, settings: Any, model_fingerprint: str, *, store: str | None = None, **model_facts: Any
    ) -> ValidationConfig:
        """The gate of an encode or prefill worker: strict whatever ``EPD_VALIDATION_MODE``
        says (``vllm`` is for the vLLM-facing gate), with entry keys pinned to the worker's own
        model, so two models never share embeddings, and (``store``) entries pinned to the
        store the worker reads. ``model_facts``: what the loaded model dictates (its family's
        ``metadata_fields``, its ``merge_size``)."""
        return cls.from_settings(
            settings,
            mode="strict",
            model_fingerprint=model_fingerprint,
            store=store,
            **model_facts,
        )
