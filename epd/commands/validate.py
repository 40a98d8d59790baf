"""``epd validate``: run the safety gate on a vLLM ``GenerateRequest`` JSON file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def read_json(path: str) -> Any:
    """JSON from ``path`` (``-`` is stdin); raises ``ValueError``/``OSError`` when unreadable."""
    if path == "-":
        return json.loads(sys.stdin.read())
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def format_rejection(e: Any) -> str:
    """One stderr line naming the rule, modality, item and field of a ValidationError."""
    parts = [f"rule={e.rule}"]
    parts += [
        f"{name}={v}"
        for name in ("modality", "item", "field")
        if (v := getattr(e, name)) is not None
    ]
    return f"rejected: {' '.join(parts)}: {e.detail}"


def run(args: argparse.Namespace) -> int:
    """Exit 0 (``ok``) when accepted, 1 when rejected, 2 when the input is not readable JSON."""
    from runtime.settings import get_settings
    from schemas.errors import ValidationError
    from schemas.validator import ValidationConfig, validate_features
    from schemas.vllm_wire import parse_generate_request

    try:
        obj = read_json(args.file)
    except (OSError, ValueError) as e:
        print(f"error: cannot read JSON from {args.file}: {e}", file=sys.stderr)
        return 2
    config = ValidationConfig.from_settings(
        get_settings(),
        mode=args.mode,
        secret=args.secret.encode() if args.secret else None,
        merge_size=args.merge_size,
        namespace=args.namespace,
    )
    try:
        req = parse_generate_request(obj)
        validate_features(req.token_ids, req.features, req.ec_transfer_params, config)
    except ValidationError as e:
        print(format_rejection(e), file=sys.stderr)
        return 1
    print("ok")
    return 0


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
        "--merge-size", type=int, default=None, help="spatial merge size (default 2, Qwen2-VL)"
    )
    p.add_argument("--namespace", default=None, help="embedding key namespace (default 'ec')")
    p.set_defaults(func=run)
