"""Bearer tokens -> tenants, and the cache salt each tenant's requests run with."""

from __future__ import annotations

import hmac
import json

from producers.api.errors import ApiError


class Tenants:
    """The tenants of ``EPD_API_TOKENS``; none means an open API (one shared tenant, None)."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = [(token.encode(), name) for token, name in tokens.items()]
        self.names = frozenset(tokens.values())

    @property
    def open(self) -> bool:
        """True when no token is configured: every caller is the anonymous tenant (None)."""
        return not self._tokens

    def identify(self, token: str | None) -> str | None:
        """The tenant of a bearer token; 401 ``auth.token`` when tokens are configured and
        ``token`` is none of them (None on an open API)."""
        if self.open:
            return None
        given = (token or "").strip().encode()
        tenant = None
        # Constant-time comparison against every token: timing says nothing about them.
        for known, name in self._tokens:
            if hmac.compare_digest(known, given):
                tenant = name
        if tenant is None:
            raise ApiError(
                401,
                "unauthorized",
                "a valid bearer token is required (Authorization: Bearer TOKEN)",
                rule="auth.token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tenant

    @staticmethod
    def salt(tenant: str | None, salt: str | None) -> str | None:
        """The cache salt a request runs with: the tenant's own namespace, then the client's
        salt. JSON framing keeps the pair unambiguous (tenant "a" with salt "b:c" never meets
        tenant "a:b")."""
        if tenant is None:
            return salt
        return "tenant:" + json.dumps([tenant, salt])
