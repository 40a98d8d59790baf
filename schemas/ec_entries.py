"""``ec_transfer_params`` entries: finding an item's entry and the strict checks of one.

Rules ``ec-entry``, ``ec-namespace``, ``ec-key``, ``ec-signature``, ``ec-store`` and
``ec-expired`` of the
safety gate (:mod:`schemas.validator`, which re-exports these functions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from schemas.errors import ValidationError
from schemas.signing import verify_ec
from schemas.types import ECTransfer

if TYPE_CHECKING:
    from schemas.validation_config import ValidationConfig

_EC_FIELDS = ("store", "key", "expires_ms", "signature")


def without_credentials(url: str) -> str:
    """``url`` without a user or password (store URLs may carry Redis credentials; rejection
    messages reach DLQ headers and status records)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable store URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def short_repr(v: Any) -> str:
    """``repr(v)`` cut to 60 characters, for messages that quote input values."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def find_ec_entry(params: Mapping[str, Any] | None, mm_hash: str) -> Any | None:
    """The ``ec_transfer_params`` entry for ``mm_hash``, or None.

    Accepts our ``dict[str, ECTransfer]`` and both shapes vLLM connectors use:
    ``{mm_hash: {...}}`` and ``{"ec_items": [{"mm_hash": ..., ...}, ...]}``.
    """
    if not params:
        return None
    items = params.get("ec_items")
    if isinstance(items, list):
        for e in items:
            h = (
                e.mm_hash
                if isinstance(e, ECTransfer)
                else (e.get("mm_hash") if isinstance(e, Mapping) else None)
            )
            if h == mm_hash:
                return e
    if mm_hash in params:
        return params[mm_hash]
    return None


def ec_entry_json(ec: ECTransfer) -> dict[str, Any]:
    """One entry as JSON, ``{mm_hash, store, key, expires_ms, signature}``: the shape
    :func:`_as_ec_transfer` reads back (the render split, the vLLM backend and the EC connector
    all write it)."""
    return {
        "mm_hash": ec.mm_hash,
        "store": ec.store,
        "key": ec.key,
        "expires_ms": ec.expires_ms,
        "signature": ec.signature,
    }


def _as_ec_transfer(entry: Any, mm_hash: str) -> ECTransfer | None:
    """An ECTransfer view of an entry, or None when it lacks the fields."""
    if isinstance(entry, ECTransfer):
        return entry
    if isinstance(entry, Mapping) and all(k in entry for k in _EC_FIELDS):
        try:
            return ECTransfer(
                mm_hash=str(entry.get("mm_hash", mm_hash)),
                store=str(entry["store"]),
                key=str(entry["key"]),
                expires_ms=int(entry["expires_ms"]),
                signature=str(entry["signature"]),
            )
        except (TypeError, ValueError):
            return None
    return None


def check_ec_key(
    key: str,
    mm_hash: str,
    config: ValidationConfig,
    *,
    modality: str | None,
    item: int | None,
    signed: bool = False,
) -> None:
    """Rules ``ec-namespace`` and ``ec-key``: the key is this item's embedding key.

    ``{namespace}:{model_fingerprint}:{hash}``, so an entry cannot point a worker at another
    model's embeddings, nor at claim-checked encoder inputs (``{namespace}:claim:...``). The hash
    is the item's ``mm_hash`` exactly, except for an entry whose signature is verified right after
    (``signed``): the fan-out keys the store by its own content hash, which differs from the
    label a vLLM render carries, and the signature binds the two.
    """
    where: dict[str, Any] = {"modality": modality, "item": item, "field": "ec_transfer_params"}
    if not key.startswith(f"{config.namespace}:"):
        raise ValidationError(
            "ec-namespace", f"key {key!r} is outside namespace {config.namespace!r}", **where
        )
    fingerprint, _, key_hash = key[len(config.namespace) + 1 :].rpartition(":")
    if (
        not fingerprint
        or not key_hash
        or ":" in fingerprint
        or (config.model_fingerprint is not None and fingerprint != config.model_fingerprint)
        or (key_hash != mm_hash and not signed)
    ):
        expected = f"{config.namespace}:{config.model_fingerprint or '<model>'}:{mm_hash}"
        raise ValidationError("ec-key", f"key {key!r} is not {expected!r}", **where)


def _is_empty(v: Any) -> bool:
    sized = isinstance(v, str | bytes | Mapping | list | tuple)
    return v is None or v is False or (sized and not v)


def entry_locates_embedding(entry: Any) -> bool:
    """Whether an ``ec_transfer_params`` entry carries something a connector can fetch the
    embedding with: an ECTransfer with a key, or a map with a non-empty value besides its
    ``mm_hash`` label (our ``key``, a connector's ``transfer_id``...). ``{}``, ``false``,
    ``null`` or ``{"mm_hash": h}`` alone point nowhere."""
    if isinstance(entry, ECTransfer):
        return bool(entry.key)
    if not isinstance(entry, Mapping):
        return False
    return any(k != "mm_hash" and not _is_empty(v) for k, v in entry.items())


def check_ec_entry(
    entry: Any,
    mm_hash: str,
    config: ValidationConfig,
    *,
    modality: str | None,
    item: int | None,
    request_id: str | None = None,
) -> None:
    """Strict checks of one entry: non-empty, shape, ``mm_hash``, namespace, signature, store,
    expiry.

    ``request_id``: the request of the event that carries the entry; signatures bind it."""
    if not entry_locates_embedding(entry):
        raise ValidationError(
            "ec-entry",
            f"entry for {mm_hash!r} ({type(entry).__name__} {short_repr(entry)}) carries nothing a "
            "connector can fetch the embedding with",
            modality=modality,
            item=item,
            field="ec_transfer_params",
        )
    ec = _as_ec_transfer(entry, mm_hash)
    if ec is None:
        if config.secret is not None:
            raise ValidationError(
                "ec-entry",
                f"entry for {mm_hash!r} must carry {', '.join(_EC_FIELDS)} to be verified",
                modality=modality,
                item=item,
                field="ec_transfer_params",
            )
        key = entry.get("key") if isinstance(entry, Mapping) else None
        if isinstance(key, str):
            check_ec_key(key, mm_hash, config, modality=modality, item=item)
        return
    if ec.mm_hash != mm_hash:
        raise ValidationError(
            "ec-entry",
            f"entry names mm_hash {ec.mm_hash!r}, item has {mm_hash!r}",
            modality=modality,
            item=item,
            field="ec_transfer_params",
        )
    signed = config.secret is not None
    check_ec_key(ec.key, mm_hash, config, modality=modality, item=item, signed=signed)
    if config.secret is not None and not verify_ec(config.secret, ec, request_id=request_id):
        raise ValidationError(
            "ec-signature",
            f"signature of the entry for {mm_hash!r} does not verify",
            modality=modality,
            item=item,
            field="ec_transfer_params",
        )
    if config.store is not None and ec.store != config.store:
        # After the signature: a verified entry names the store the fan-out really parked the
        # item in, so the mismatch is a configuration error, said at once instead of a wait.
        raise ValidationError(
            "ec-store",
            f"the entry for {mm_hash!r} names store {without_credentials(ec.store)!r}, this "
            f"worker reads {without_credentials(config.store)!r} (EPD_STORE_URL must be the "
            "same for the fan-out and the workers)",
            modality=modality,
            item=item,
            field="ec_transfer_params",
        )
    if config.now_ms is not None:
        check_ec_expiry(ec, mm_hash, config.now_ms(), modality=modality, item=item)


def check_ec_expiry(
    entry: Any, mm_hash: str, now_ms: int, *, modality: str | None, item: int | None
) -> None:
    """Rule ``ec-expired`` alone: ``entry`` (if it carries an expiry) has not passed ``now_ms``."""
    ec = _as_ec_transfer(entry, mm_hash)
    if ec is not None and ec.expires_ms <= now_ms:
        raise ValidationError(
            "ec-expired",
            f"entry for {mm_hash!r} expired at {ec.expires_ms}",
            modality=modality,
            item=item,
            field="ec_transfer_params",
        )
