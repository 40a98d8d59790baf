"""The hosts an operator lets the API fetch image and video URLs from (``EPD_API_IMAGE_URL_HOSTS``).

An entry is ``HOST`` (any port) or ``HOST:PORT``; IPv6 addresses go in brackets (``[::1]:8080``).
Host names compare case-insensitively and without a trailing dot; nothing else is normalised
(no wildcard, no resolution: ``localhost`` does not allow ``127.0.0.1``). The empty setting, the
default, allows nothing. Parsing is strict, so a typo stops the API at start-up instead of
silently allowing less (or more) than the operator meant.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")


@dataclass(frozen=True, slots=True)
class UrlHosts:
    """The allowed ``(host, port)`` pairs; a port of None allows every port of the host."""

    entries: frozenset[tuple[str, int | None]] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def allows(self, host: str, port: int) -> bool:
        """Whether a URL at ``host`` (as a URL parser gives it) and ``port`` may be fetched."""
        name = normalise_host(host)
        return (name, port) in self.entries or (name, None) in self.entries


def normalise_host(host: str) -> str:
    """A host as the allow-list compares it: lower case, no brackets, no trailing dot, an IP
    address in its canonical spelling."""
    name = host.strip().strip("[]").rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _host(text: str, entry: str) -> str:
    name = normalise_host(text)
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if not name or len(name) > 253 or not _NAME.fullmatch(name):
        raise ValueError(f"{entry!r} is not HOST or HOST:PORT")
    return name


def parse_url_hosts(text: str) -> UrlHosts:
    """The allow-list written in ``text`` (comma separated); ``ValueError`` naming a bad entry."""
    if not text.strip():
        return UrlHosts()
    entries: set[tuple[str, int | None]] = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            raise ValueError("an empty entry (two commas, or a trailing one)")
        if "://" in entry or "/" in entry or "@" in entry:
            raise ValueError(f"{entry!r}: give a host (HOST or HOST:PORT), not a URL")
        host, port = entry, None
        if entry.startswith("["):
            inside, sep, rest = entry[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"{entry!r} is not [IPV6] or [IPV6]:PORT")
            host, port = inside, rest[1:] if rest else None
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        elif ":" in entry:
            raise ValueError(f"{entry!r}: write an IPv6 address in brackets ([::1] or [::1]:80)")
        number: int | None = None
        if port is not None:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{entry!r}: the port must be 1-65535")
            number = int(port)
        entries.add((_host(host, entry), number))
    return UrlHosts(frozenset(entries))
