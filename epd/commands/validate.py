"""``epd validate``: run the safety gate on a vLLM ``GenerateRequest`` JSON file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def read_json(path: str) -> Any:
    """JSON from ``path`` (``-`` is stdin); raises ``ValueError``/``OSError`` when unreadable.

    Nesting deeper than the interpreter can parse is a ``ValueError`` too (json raises
    ``RecursionError`` for it), and so is text that is not UTF-8.
    """
    try:
        if path == "-":
            return json.loads(sys.stdin.read())
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


_CONTROL = {c: f"\\u{c:04x}" for c in (*range(32), 127, 0x85, 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """``text`` with control characters escaped: names taken from the input (a modality key
    holding a newline) must not break the one-line answer."""
    return text.translate(_CONTROL)


def format_rejection(e: Any) -> str:
    """One stderr line naming the rule, modality, item and field of a ValidationError."""
    parts = [f"rule={e.rule}"]
    parts += [
        f"{name}={v}"
        for name in ("modality", "item", "field")
        if (v := getattr(e, name)) is not None
    ]
    return one_line(f"rejected: {' '.join(parts)}: {e.detail}")


def run(args: argparse.Namespace) -> int:
    """Exit 0 (``ok``) when accepted, 1 when rejected, 2 when the input is not readable JSON.

    Every outcome is one line; no input produces a traceback (an unexpected exception would be
    a validator bug, reported as such with exit 2 so a caller never mistakes it for ``ok``).
    """
    try:
        return _run(args)
    except Exception as e:  # the last line of defence; tests fuzz that it is never reached
        print(one_line(f"error: validator bug: {type(e).__name__}: {e}"), file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from runtime.settings import get_settings
    from schemas.errors import ValidationError
    from schemas.validator import ValidationConfig
    from schemas.vllm_wire import validate_request_json

    try:
        obj = read_json(args.file)
    except (OSError, ValueError) as e:
        print(one_line(f"error: cannot read JSON from {args.file}: {e}"), file=sys.stderr)
        return 2
    config = ValidationConfig.from_settings(
        get_settings(),
        mode=args.mode,
        secret=args.secret.encode() if args.secret else None,
        merge_size=args.merge_size,
        namespace=args.namespace,
    )
    try:
        validate_request_json(obj, config)
    except ValidationError as e:
        print(format_rejection(e), file=sys.stderr)
        return 1
    print("ok")
    return 0


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a merge size of 0 would divide by zero)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def register(subparsers: Any) -> None:
    """Add ``epd validate``."""
    p = subparsers.add_parser(
        "validate",
        help="validate a vLLM GenerateRequest JSON against the safety rules",
        description="Exit 0 and print 'ok' when accepted; exit 1 with the rule, modality and "
        "item on stderr when rejected; exit 2 when the input is not readable JSON.",
    )
    p.add_argument("file", metavar="FILE", help="GenerateRequest JSON file, or - for stdin")
    p.add_argument(
        "--mode",
        choices=("strict", "vllm"),
        default=None,
        help="strict (this pipeline, default from EPD_VALIDATION_MODE) or vllm (vLLM's rules)",
    )
    p.add_argument("--secret", default=None, help="HMAC key for EC entries (default EPD_EC_SECRET)")
    p.add_argument(
        "--merge-size",
        type=positive_int,
        default=None,
        help="spatial merge size (default 2, Qwen2-VL)",
    )
    p.add_argument("--namespace", default=None, help="embedding key namespace (default 'ec')")
    p.set_defaults(func=run)
