"""The numeric options of a Redis store URL (``?max_connections=``, ``?socket_timeout=``,
``?socket_connect_timeout=``), read and checked in one place: by the settings when
``EPD_STORE_URL`` is read (the earliest point that can know), and by the stores that apply them.
Imports nothing heavy: the settings check runs in every process."""

from __future__ import annotations

import math
from urllib.parse import parse_qsl, urlsplit

COUNTS = ("max_connections",)
SECONDS = ("socket_timeout", "socket_connect_timeout")


def url_count(query: dict[str, str], name: str, default: int) -> int:
    """``name``'s whole number of at least 1 (``default`` when absent); ``ValueError`` naming
    the option otherwise (not its value: a URL may hold a secret)."""
    raw = query.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(str(raw))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"store URL option {name} must be a whole number of at least 1")
    return value


def url_seconds(query: dict[str, str], name: str) -> float | None:
    """``name``'s seconds, above 0 and finite (None when absent or ``None``); ``ValueError``
    naming the option otherwise."""
    raw = query.get(name)
    if raw in (None, "", "None"):
        return None
    try:
        value = float(str(raw))
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"store URL option {name} must be a number of seconds above 0")
    return value


def check_store_options(url: str) -> None:
    """Refuse a store URL whose numeric options would not apply (see :func:`url_count`)."""
    query = dict(parse_qsl(urlsplit(url).query))
    for name in COUNTS:
        url_count(query, name, 1)
    for name in SECONDS:
        url_seconds(query, name)
