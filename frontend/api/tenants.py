"""Bearer tokens -> tenants, and the cache salt each tenant's requests run with.

Salts live in two namespaces that cannot meet. A tenant's salt is ``tenant:`` + an HMAC, keyed
by a key derived from ``EPD_EC_SECRET``, of the tenant and its client salt: every replica with
the secret derives the same one (the cache works across replicas), and no client can produce it.
A salt a client sends to an open API (no tokens) runs as ``client:`` + that salt, so not even an
open replica beside tenanted ones can be handed a tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from frontend.api.errors import ApiError

SALT_KEY_DOMAIN = b"epd-pipeline tenant cache salt v1"
"""Domain separation: the salt key is not the signing key itself."""
TENANT_SALT_PREFIX = "tenant:"
CLIENT_SALT_PREFIX = "client:"


class Tenants:
    """The tenants of ``EPD_API_TOKENS``; none means an open API (one shared tenant, None)."""

    def __init__(self, tokens: dict[str, str], *, secret: bytes | None) -> None:
        self._tokens = [(token.encode(), name) for token, name in tokens.items()]
        self.names = frozenset(tokens.values())
        self._salt_key = hmac.new(secret or b"", SALT_KEY_DOMAIN, hashlib.sha256).digest()

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

    def salt(self, tenant: str | None, salt: str | None) -> str | None:
        """The cache salt a request runs with (see the module docstring). JSON framing keeps
        the tenant and its salt apart (tenant "a" with salt "b:c" never meets tenant "a:b")."""
        if tenant is None:
            return None if salt is None else CLIENT_SALT_PREFIX + salt
        framed = json.dumps([tenant, salt]).encode()
        return TENANT_SALT_PREFIX + hmac.new(self._salt_key, framed, hashlib.sha256).hexdigest()


class AdminTokens:
    """Who may call the admin routes: a token of ``EPD_ADMIN_TOKENS``; without any, every
    caller of an open API (and nobody on a tenanted one: a tenant is not an operator)."""

    def __init__(self, tokens: dict[str, str], *, api_open: bool) -> None:
        self._tokens = [token.encode() for token in tokens]
        self.api_open = api_open

    def check(self, token: str | None) -> None:
        """Return when ``token`` may use the admin routes; 401/403 naming the rule otherwise."""
        if not self._tokens:
            if self.api_open:
                return
            raise ApiError(
                403,
                "forbidden",
                "admin routes need an admin token, and none is configured (EPD_ADMIN_TOKENS)",
                rule="auth.admin",
            )
        given = (token or "").strip().encode()
        if not any([hmac.compare_digest(known, given) for known in self._tokens]):
            raise ApiError(
                401 if not token else 403,
                "unauthorized" if not token else "forbidden",
                "an admin bearer token is required (EPD_ADMIN_TOKENS)",
                rule="auth.admin",
                headers={"WWW-Authenticate": "Bearer"},
            )
