"""A body's JSON text, parsed under the rules that keep a hostile body cheap: no ``NaN``, a
bounded depth, no lone surrogates, and texts far over their limit refused from the raw bytes
before anything is parsed."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from frontend.api.errors import bad_request
from schemas.errors import ValidationError


def _not_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send a finite number")


def parse_json(body: bytes | str, max_depth: int, *, where: str = "body") -> Any:
    """JSON text as Python values; 400 ``body.json`` for anything else: malformed text,
    ``NaN``/``Infinity`` (Python's parser takes them, JSON has none), objects and arrays
    nested deeper than ``max_depth`` (a deep body would exhaust the parser's recursion or the
    code that walks it), or a string (value or key) holding a lone UTF-16 surrogate (JSON's
    ``"\\ud800"``: Python keeps it as a code point no UTF-8 encoder takes, so the tokenizer,
    the Avro event or Redis would fail on it long after the door)."""
    try:
        obj = json.loads(body, parse_constant=_not_json_number)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"{where} is not JSON: {e}", rule="body.json") from None
    except ValueError as e:  # NaN / Infinity
        raise bad_request(f"{where}: {e}", rule="body.json") from None
    except RecursionError:
        raise bad_request(
            f"{where} is nested too deeply (the limit is {max_depth} levels)", rule="body.json"
        ) from None
    problem = _tree_problem(obj, max_depth, strings=_may_hold_surrogate(body))
    if problem == "depth":
        raise bad_request(
            f"{where} is nested too deeply (the limit is {max_depth} levels, "
            "EPD_API_MAX_JSON_DEPTH)",
            rule="body.json",
        )
    if problem == "surrogate":
        raise bad_request(
            f"{where} holds a string with a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
            "escape); send text as valid Unicode",
            rule="body.json",
        )
    return obj


BYTES_PER_CHAR = 12
"""The most bytes one character of a JSON string can take (a surrogate pair written as two
``\\u`` escapes): a string of more bytes than this many times a limit holds more characters
than the limit, whatever it is made of."""
_WINDOWS = 4
"""Quote-free windows per over-long string length :func:`refuse_long_text` looks through."""


def refuse_long_text(body: bytes, keys: tuple[str, ...], max_chars: int) -> None:
    """413 ``request.prompt`` for a text field (a string value of one of ``keys``) that holds
    more than ``max_chars`` characters for certain, found in the raw bytes before anything is
    parsed: parsing a 30 MB body holds the GIL (so the event loop) for most of a second, only
    for the prompt's limit to refuse it afterwards.

    A string of more than ``BYTES_PER_CHAR * max_chars`` bytes has no quote in that span: the
    body is looked through in windows a quarter that long (a few ``bytes.find`` calls, never a
    Python loop over its bytes); a quote-free window's run is taken back to the quote that
    opened it, and refused when that quote opens the value of a text key written plainly
    (``{"prompt": "`` / ``, "content": "``: a key's quote after ``{``, ``,`` or a space is
    outside every string). Shorter texts, or keys written with escapes, are left to the
    parse, which holds every text to the exact limit."""
    span = BYTES_PER_CHAR * max_chars
    step = max(1, span // _WINDOWS)
    at = 0
    while at + step <= len(body):
        if body.find(b'"', at, at + step) != -1:
            at += step
            continue
        opened = body.rfind(b'"', 0, at)
        closed = body.find(b'"', at + step)
        end = len(body) if closed == -1 else closed
        if opened != -1 and end - opened - 1 > span:
            key = _text_key(body[max(0, opened - 64) : opened + 1], keys)
            if key is not None:
                raise ValidationError(
                    "request.prompt",
                    f"{key!r} holds a string of {end - opened - 1} bytes or more: more than "
                    f"{max_chars} characters (EPD_API_MAX_PROMPT_CHARS)",
                    field=key,
                )
        if closed == -1:
            return
        at = closed + 1


_KEYED_STRING = re.compile(rb'[{,\s]"([A-Za-z_]{1,32})"\s*:\s*"\Z')
"""A plainly written key, its colon and the quote that opens its string value, at the end of
the bytes before a long string."""


def _text_key(before: bytes, keys: tuple[str, ...]) -> str | None:
    """The key whose string value opens at the end of ``before``, when it is one of ``keys``."""
    match = _KEYED_STRING.search(before)
    if match is None:
        return None
    key = match.group(1).decode()
    return key if key in keys else None


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point: json.loads joins a well-formed escaped pair into one character, so
any left in a parsed string is half a pair."""


ESCAPES_SCANNED = 256
"""``\\u`` escapes :func:`_may_hold_surrogate` looks at before it leaves the question to the
scan of the parsed strings."""


def _may_hold_surrogate(body: bytes | str) -> bool:
    """Whether the JSON text can hold a lone surrogate, by a scan of its bytes far cheaper
    than a regex over every parsed string (which held the GIL for most of a second per 30 MB
    body): UTF-8 text holds one only as a ``\\uD800``-``\\uDFFF`` escape or as raw
    ``ED A0``-``ED BF`` bytes (``json.loads`` decodes with ``surrogatepass``). Other
    encodings, text already decoded, and many escapes: True (the strings are scanned)."""
    if not isinstance(body, bytes) or not json.detect_encoding(body).startswith("utf-8"):
        return True
    for marker, follows in ((b"\\u", b"dD"), (b"\xed", None)):
        at, seen = body.find(marker), 0
        while at != -1:
            nxt = body[at + len(marker) : at + len(marker) + 2]
            if follows is None:
                if nxt[:1] and 0xA0 <= nxt[0] <= 0xBF:
                    return True
            elif nxt[:1] and nxt[:1] in follows and nxt[1:2] and nxt[1:2] in b"89abcdefABCDEF":
                return True
            seen += 1
            if seen > ESCAPES_SCANNED:
                return True
            at = body.find(marker, at + 1)
    return False


def _tree_problem(obj: Any, limit: int, *, strings: bool = True) -> str | None:
    """``"depth"`` when objects/arrays nest more than ``limit`` levels, ``"surrogate"`` when a
    string or key holds a lone surrogate (looked for only when ``strings``), else None
    (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if strings and _SURROGATE.search(node):
                return "surrogate"
            continue
        if not isinstance(node, dict | list):
            continue  # a number, a boolean, null
        if depth > limit:
            return "depth"
        if isinstance(node, dict):
            stack.extend((k, depth) for k in node)
            children: Any = node.values()
        else:
            children = node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | str))
    return None


def fingerprint(obj: Any) -> str:
    """A parsed body's meaning, not its formatting (key order and whitespace do not matter):
    what ``Idempotency-Key`` compares."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()
