"""``Idempotency-Key``: the key and the body's fingerprint live in Redis, so every API replica
sees the same claim. Same key + same body -> the same request; same key + other body -> a
``conflict`` refusal (409 at the HTTP API)."""

from __future__ import annotations

import hashlib
import json

from producers.refusal import Refused
from runtime.redis.cluster import RedisClient
from schemas.keys import RedisKeys


class IdempotencyStore:
    """Claims of ``(tenant, key)`` -> ``{fingerprint, request_id}`` with a TTL."""

    def __init__(
        self, client: RedisClient, prefix: str, ttl_s: int, *, max_key_chars: int = 255
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.keys = RedisKeys(prefix)
        self.ttl_s = ttl_s
        self.max_key_chars = max_key_chars

    def _key(self, tenant: str | None, key: str) -> str:
        # Hashed: client keys may hold any characters; the tenant keeps tenants apart.
        digest = hashlib.sha256(key.encode()).hexdigest()
        return self.keys.idempotency(tenant, digest)

    def check_key(self, key: str) -> None:
        """Refuse (``malformed``) an empty or oversized key."""
        if not key or len(key) > self.max_key_chars:
            raise Refused(
                "malformed",
                f"Idempotency-Key must have 1 to {self.max_key_chars} characters",
                rule="idempotency.key",
                field="Idempotency-Key",
            )

    async def claim(
        self, tenant: str | None, key: str, fingerprint: str, request_id: str
    ) -> tuple[bool, str]:
        """``(True, request_id)`` when this call owns the key now; ``(False, earlier_id)`` when
        the same body was sent before with it; a ``conflict`` refusal when another body was."""
        rkey = self._key(tenant, key)
        value = json.dumps({"fingerprint": fingerprint, "request_id": request_id})
        for _ in range(3):
            if await self.client.set(rkey, value, nx=True, ex=self.ttl_s):
                return True, request_id
            raw = await self.client.get(rkey)
            if raw is None:
                continue  # expired or released between SET and GET: try to claim again
            held = json.loads(raw)
            if held["fingerprint"] != fingerprint:
                raise Refused(
                    "conflict",
                    "this Idempotency-Key was used with a different request body",
                    rule="idempotency.body_mismatch",
                    field="Idempotency-Key",
                    code="idempotency_conflict",
                )
            return False, str(held["request_id"])
        raise Refused(
            "conflict",
            "Idempotency-Key is contended; retry",
            rule="idempotency.contended",
            field="Idempotency-Key",
            code="idempotency_conflict",
        )

    async def release(self, tenant: str | None, key: str, request_id: str) -> None:
        """Drop a claim whose request was never enqueued (only if it is still ours)."""
        rkey = self._key(tenant, key)
        raw = await self.client.get(rkey)
        if raw is not None and json.loads(raw).get("request_id") == request_id:
            await self.client.delete(rkey)
