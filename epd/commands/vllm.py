"""``epd vllm``: vLLM scale-out JSON interop (``split`` a render response for E/P/D)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from epd.commands.validate import format_rejection, one_line, read_json


def _ec_params(text: str | None) -> Any:
    """``--ec-transfer-params``: inline JSON, or ``@FILE``."""
    if text is None:
        return None
    if text.startswith("@"):
        return read_json(text[1:])
    return json.loads(text)


def run_split(args: argparse.Namespace) -> int:
    """Print ``{"encode": [...], "prefill": {...}}``; exit 1 on a rejected render, 2 on bad JSON.

    One line on stderr for every failure, never a traceback (see ``epd validate``).
    """
    try:
        return _run_split(args)
    except RecursionError:
        print("rejected: rule=request-shape: the render is nested too deeply", file=sys.stderr)
        return 1
    except Exception as e:  # the last line of defence, as in ``epd validate``
        print(one_line(f"error: split bug: {type(e).__name__}: {e}"), file=sys.stderr)
        return 2


def _run_split(args: argparse.Namespace) -> int:
    from runtime.settings import get_settings
    from schemas.errors import ValidationError
    from schemas.vllm_split import split_render

    settings = get_settings()
    try:
        obj = read_json(args.file)
        ec = _ec_params(args.ec_transfer_params)
    except (OSError, ValueError) as e:
        print(one_line(f"error: cannot read JSON: {e}"), file=sys.stderr)
        return 2
    if ec is not None and not isinstance(ec, dict):
        print("error: --ec-transfer-params must be a JSON object", file=sys.stderr)
        return 2
    secret = args.secret.encode() if args.secret else settings.secret_bytes()
    try:
        out = split_render(
            obj,
            ec,
            secret=secret,
            namespace=args.namespace or settings.ec_namespace,
            store=args.store or settings.embedding_store_url,
            model_fingerprint=args.model_fingerprint or settings.model,
            ttl_s=args.ttl_s if args.ttl_s is not None else settings.embedding_ttl_s,
        )
    except ValidationError as e:
        print(format_rejection(e), file=sys.stderr)
        return 1
    json.dump(out, sys.stdout, indent=args.indent)
    sys.stdout.write("\n")
    return 0


def register(subparsers: Any) -> None:
    """Add ``epd vllm split``."""
    p = subparsers.add_parser("vllm", help="vLLM scale-out JSON interop")
    sub = p.add_subparsers(dest="vllm_command", metavar="ACTION")
    s = sub.add_parser(
        "split",
        help="split a render response into encode requests and a metadata-only prefill request",
    )
    s.add_argument("file", metavar="RENDER.json", help="render response JSON, or - for stdin")
    s.add_argument(
        "--ec-transfer-params",
        default=None,
        help="ec_transfer_params JSON (or @FILE); default: signed entries keyed by mm_hash",
    )
    s.add_argument("--secret", default=None, help="HMAC key (default EPD_EC_SECRET)")
    s.add_argument("--namespace", default=None, help="embedding key namespace (default 'ec')")
    s.add_argument("--store", default=None, help="embedding store URI (default EPD_STORE_URL)")
    s.add_argument("--model-fingerprint", default=None, help="key component (default EPD_MODEL)")
    s.add_argument("--ttl-s", type=int, default=None, help="entry lifetime (EPD_EMBEDDING_TTL_S)")
    s.add_argument("--indent", type=int, default=None, help="pretty-print JSON")
    s.set_defaults(func=run_split)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])
