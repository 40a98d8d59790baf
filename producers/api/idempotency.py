"""``Idempotency-Key``: the key and the body's fingerprint live in Redis, so every API replica
sees the same claim. Same key + same body -> the same request; same key + other body -> 409."""

from __future__ import annotations

import hashlib
import json

import redis.asyncio as aioredis

from producers.api.errors import ApiError

MAX_KEY_LENGTH = 255


class IdempotencyStore:
    """Claims of ``(tenant, key)`` -> ``{fingerprint, request_id}`` with a TTL."""

    def __init__(self, client: aioredis.Redis, prefix: str, ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def _key(self, tenant: str | None, key: str) -> str:
        # Hashed: client keys may hold any characters; the tenant keeps tenants apart.
        digest = hashlib.sha256(key.encode()).hexdigest()
        return f"{self.prefix}:idem:{tenant or '-'}:{digest}"

    @staticmethod
    def check_key(key: str) -> None:
        """400 for an empty or oversized key."""
        if not key or len(key) > MAX_KEY_LENGTH:
            raise ApiError(
                400,
                "malformed",
                f"Idempotency-Key must have 1 to {MAX_KEY_LENGTH} characters",
                rule="idempotency.key",
                field="Idempotency-Key",
            )

    async def claim(
        self, tenant: str | None, key: str, fingerprint: str, request_id: str
    ) -> tuple[bool, str]:
        """``(True, request_id)`` when this call owns the key now; ``(False, earlier_id)`` when
        the same body was sent before with it; 409 when another body was."""
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
                raise ApiError(
                    409,
                    "idempotency_conflict",
                    "this Idempotency-Key was used with a different request body",
                    rule="idempotency.body_mismatch",
                    field="Idempotency-Key",
                )
            return False, str(held["request_id"])
        raise ApiError(
            409,
            "idempotency_conflict",
            "Idempotency-Key is contended; retry",
            rule="idempotency.contended",
            field="Idempotency-Key",
        )

    async def release(self, tenant: str | None, key: str, request_id: str) -> None:
        """Drop a claim whose request was never enqueued (only if it is still ours)."""
        rkey = self._key(tenant, key)
        raw = await self.client.get(rkey)
        if raw is not None and json.loads(raw).get("request_id") == request_id:
            await self.client.delete(rkey)
