"""HMAC signatures on ``ec_transfer_params`` entries, and the embedding and claim key layout.

The fan-out signs each entry; the prefill side checks the signature and that the key stays
inside the configured namespace, so a forged event cannot point a worker at another tenant's
embeddings.
"""

from __future__ import annotations

import hashlib
import hmac

from schemas.types import ECTransfer


def embedding_key(namespace: str, model_fingerprint: str, mm_hash: str) -> str:
    """Store key of one item's embeddings: ``{namespace}:{model_fingerprint}:{mm_hash}``."""
    return f"{namespace}:{model_fingerprint}:{mm_hash}"


def claim_key(namespace: str, mm_hash: str, field_name: str) -> str:
    """Store key of a claim-checked encoder input: ``{namespace}:claim:{mm_hash}:{field}``.

    The fan-out writes it; the encode worker reads it and deletes it once the item's embedding is
    stored (and deletes nothing that is not exactly this key for the event's item).
    """
    return f"{namespace}:claim:{mm_hash}:{field_name}"


def _message(mm_hash: str, store: str, key: str, expires_ms: int) -> bytes:
    # Unit separators keep field boundaries unambiguous ("a|b" + "c" != "a" + "b|c").
    return "\x1f".join(("epd-ec-v1", mm_hash, store, key, str(expires_ms))).encode()


def sign_ec(secret: bytes, *, mm_hash: str, store: str, key: str, expires_ms: int) -> str:
    """Hex HMAC-SHA256 over one entry's fields."""
    return hmac.new(secret, _message(mm_hash, store, key, expires_ms), hashlib.sha256).hexdigest()


def make_ec_transfer(
    *, mm_hash: str, store: str, key: str, expires_ms: int, secret: bytes | None
) -> ECTransfer:
    """An ``ec_transfer_params`` entry, signed when a secret is configured."""
    sig = (
        sign_ec(secret, mm_hash=mm_hash, store=store, key=key, expires_ms=expires_ms)
        if secret
        else ""
    )
    return ECTransfer(mm_hash=mm_hash, store=store, key=key, expires_ms=expires_ms, signature=sig)


def verify_ec(secret: bytes, ec: ECTransfer) -> bool:
    """True when the entry's signature matches its fields under ``secret`` (constant time)."""
    expected = sign_ec(
        secret, mm_hash=ec.mm_hash, store=ec.store, key=ec.key, expires_ms=ec.expires_ms
    )
    return hmac.compare_digest(expected, ec.signature)
