"""Which key holds an item, the signed entry a producer hands out for it, and the check a
consumer makes before it trusts one.

The checks are the safety gate's own (:func:`schemas.ec_entries.check_ec_entry`, rules
``ec-entry`` ... ``ec-expired``), so the connector and our prefill worker refuse exactly the
same entries. Entries are bound to no request (``request_id=None``): vLLM's encoder and
prefill instances give one request different ids, so there is no id both sides know; the
signature still binds the item's ``mm_hash``, the store, the key and the expiry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd_vllm_ec.settings import ConnectorSettings
from schemas.ec_entries import check_ec_entry, ec_entry_json, find_ec_entry
from schemas.errors import ValidationError
from schemas.keys import embedding_key
from schemas.signing import make_ec_transfer
from schemas.validation_config import ValidationConfig


def item_key(settings: ConnectorSettings, mm_hash: str) -> str:
    """The store key of an item's encoder output: ``{namespace}:{model_fingerprint}:{mm_hash}``
    (:func:`schemas.keys.embedding_key`, the key our encode worker writes)."""
    return embedding_key(settings.namespace, settings.model_fingerprint, mm_hash)


def signed_entry(
    settings: ConnectorSettings, store_url: str, mm_hash: str, expires_ms: int
) -> dict[str, Any]:
    """The ``ec_transfer_params`` entry for an item this producer stored, signed."""
    ec = make_ec_transfer(
        mm_hash=mm_hash,
        store=store_url,
        key=item_key(settings, mm_hash),
        expires_ms=expires_ms,
        secret=settings.secret,
    )
    return ec_entry_json(ec)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a consumer may do with an item: load ``key``, or not (``reason`` says why)."""

    key: str | None
    reason: str = ""
    rule: str = ""

    @property
    def trusted(self) -> bool:
        return self.key is not None


NO_ENTRY = Verdict(None, "the request carries no ec_transfer_params entry for it", "no-entry")


def verify_entry(
    params: Mapping[str, Any] | None,
    mm_hash: str,
    settings: ConnectorSettings,
    store_url: str,
    now_ms: int,
) -> Verdict:
    """Judge the request's entry for ``mm_hash``: trusted only when it is signed with our
    secret, names ``store_url`` (the store this consumer reads), keys our namespace and model
    fingerprint, and has not expired. Never raises for a bad entry: a refusal is a verdict."""
    if params is not None and not isinstance(params, Mapping):
        return Verdict(None, f"ec_transfer_params is a {type(params).__name__}", "ec-entry")
    entry = find_ec_entry(params, mm_hash)
    if entry is None:
        return NO_ENTRY
    config = ValidationConfig(
        secret=settings.secret,
        namespace=settings.namespace,
        model_fingerprint=settings.model_fingerprint,
        store=store_url,
        now_ms=lambda: now_ms,
    )
    try:
        check_ec_entry(entry, mm_hash, config, modality=None, item=None, request_id=None)
    except ValidationError as exc:
        return Verdict(None, str(exc), exc.rule)
    key = entry.get("key") if isinstance(entry, Mapping) else getattr(entry, "key", None)
    return Verdict(str(key))
