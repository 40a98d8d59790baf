"""Strict parsing of the API's bearer tokens (``EPD_API_TOKENS``, ``EPD_API_TOKENS_FILE``).

A token configuration that is wrong must stop the API, never open it: an empty entry, an entry
without a tenant, a token listed twice or a file that names no token is refused, naming the
entry by its position (and its tenant), never printing the token. The tenant is what follows
the *last* ``=`` of an entry, so a token may end in base64 ``=`` padding
(``dG9rZW4==alice``: token ``dG9rZW4=``, tenant ``alice``); tenant names cannot hold ``=``.
"""

from __future__ import annotations

import re

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}")
"""A tenant name: it appears in status records and logs, so it is kept short and plain."""
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
"""Visible ASCII without spaces: what an ``Authorization: Bearer`` header can carry."""


class TokenConfigError(ValueError):
    """A token configuration that must not start an API (the message never holds a token)."""


def parse_tokens(text: str, *, source: str, comments: bool = False) -> dict[str, str]:
    """Bearer token -> tenant from ``TOKEN=TENANT`` entries separated by commas or new lines.

    ``source`` names the setting in errors. ``comments``: blank lines and lines starting with
    ``#`` are skipped (a tokens file); otherwise every entry must hold a pair.
    """
    lines = text.splitlines() if comments else [text]
    entries: list[str] = []
    for line in lines:
        if comments and (not line.strip() or line.lstrip().startswith("#")):
            continue
        entries.extend(part.strip() for part in line.split(","))
    if not any(entries):
        raise TokenConfigError(
            f"{source} names no token (unset it for an open API, or give TOKEN=TENANT pairs)"
        )
    out: dict[str, str] = {}
    first_seen: dict[str, int] = {}
    for n, entry in enumerate(entries, start=1):
        token, tenant = _pair(entry, n, source)
        if token in first_seen:
            raise TokenConfigError(
                f"{source}: entry {n} (tenant {tenant!r}) repeats the token of entry "
                f"{first_seen[token]} (tenant {out[token]!r}); each token names one tenant"
            )
        first_seen[token] = n
        out[token] = tenant
    return out


def _pair(entry: str, n: int, source: str) -> tuple[str, str]:
    if not entry:
        raise TokenConfigError(f"{source}: entry {n} is empty (a stray comma?)")
    token, sep, tenant = entry.rpartition("=")
    if not sep or not tenant:
        raise TokenConfigError(f"{source}: entry {n} is not TOKEN=TENANT")
    if not token:
        raise TokenConfigError(f"{source}: entry {n} (tenant {tenant!r}) has an empty token")
    if not TENANT_NAME.fullmatch(tenant):
        raise TokenConfigError(
            f"{source}: entry {n} has an invalid tenant name (1-64 of A-Z a-z 0-9 . _ @ : -, "
            "starting with a letter or digit)"
        )
    if not _TOKEN_CHARS.fullmatch(token):
        raise TokenConfigError(
            f"{source}: entry {n} (tenant {tenant!r}) has a token with spaces or characters "
            "a bearer header cannot carry"
        )
    return token, tenant
