"""``epd submit`` / ``epd status`` / ``epd cancel``: the HTTP API from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

COMMON = """\
The API is at --url (default $EPD_API_URL or http://127.0.0.1:8000); give --token (default
$EPD_API_TOKEN) when the API requires bearer tokens. Exit status: 0 when the request completed
(or, without --wait, was accepted), 1 when it ended otherwise (failed, rejected, expired,
cancelled), the API refused it or an --image file cannot be read, 2 when the API cannot be
reached.
"""


def _wrap(text: str) -> str:
    return textwrap.fill(text, 92) + "\n\n"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("EPD_API_URL", "http://127.0.0.1:8000"),
        help="API base URL (default $EPD_API_URL or http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--token", default=os.environ.get("EPD_API_TOKEN"), help="bearer token ($EPD_API_TOKEN)"
    )
    p.add_argument("--json", action="store_true", help="print the status JSON instead of text")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "submit",
        help="submit a request to the HTTP API (and optionally wait for it)",
        description=_wrap(
            "Render and enqueue a prompt with images through the HTTP API (POST "
            "/v1/requests). Mark each image in the prompt with <image>, in the order of the "
            "--image options. Prints the request id; with --wait, shows the request's progress "
            "stage by stage on stderr (queued, encoding, prefilling, decoding, completed) and "
            "prints the result; with --stream, prints the text on stdout as the tokens are "
            "made (the progress and the outcome on stderr)."
        )
        + COMMON,
        formatter_class=fmt,
    )
    s.add_argument(
        "--image", action="append", type=Path, default=[], help="image file (repeatable)"
    )
    s.add_argument("--prompt", required=True, help="prompt text; <image> marks each image")
    s.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (16)")
    s.add_argument("--cache-salt", default=None, help="encoder-cache isolation label")
    s.add_argument("--deadline-s", type=float, default=None, help="give up after N seconds")
    s.add_argument("--idempotency-key", default=None, help="retry-safe submission key")
    s.add_argument("--temperature", type=float, default=None, help="0 (default): greedy")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    s.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    s.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    s.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; not printed)"
    )
    s.add_argument("--wait", action="store_true", help="wait for the outcome (progress on stderr)")
    s.add_argument(
        "--stream",
        action="store_true",
        help="print the text on stdout as it is generated (implies --wait)",
    )
    s.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits at most")
    _add_common(s)
    s.set_defaults(func=run_submit)

    st = sub.add_parser(
        "status",
        help="show a request's status (stages, result, error), or without ID the fleet",
        description=_wrap(
            "Show a request's status (GET /v1/requests/ID): its stage timings, items, result "
            "or error. With --wait, follow it stage by stage until it ends. Without ID: the "
            "pipeline's fleet as the configured Redis and broker know it (live workers per "
            "stage, lag per group and partition, dead letters, unfinished requests by status, "
            "why it cannot serve); exits 0 when it can serve, 1 when it cannot, 2 when Redis "
            "cannot be read."
        )
        + COMMON,
        formatter_class=fmt,
    )
    st.add_argument("request_id", metavar="ID", nargs="?")
    st.add_argument(
        "--no-kafka", action="store_true", help="fleet: skip the broker's offsets (lag, DLQ)"
    )
    st.add_argument("--wait", action="store_true", help="wait until it ends (progress on stderr)")
    st.add_argument("--timeout", type=float, default=300.0)
    _add_common(st)
    st.set_defaults(func=run_status)

    c = sub.add_parser(
        "cancel",
        help="cancel a request",
        description=_wrap(
            "Cancel a request (DELETE /v1/requests/ID): its status becomes 'cancelled' at once "
            "and the workers skip its remaining work (encode and prefill are skipped, decoding "
            "stops between steps). A request that already finished cannot be cancelled (exit 1)."
        )
        + COMMON,
        formatter_class=fmt,
    )
    c.add_argument("request_id", metavar="ID")
    _add_common(c)
    c.set_defaults(func=run_cancel)


def _client(args: argparse.Namespace) -> Any:
    from frontend.client import SyncEPDClient

    return SyncEPDClient(args.url, token=args.token)


def _print_status(st: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st.raw, indent=2))
        return
    print(f"request {st.request_id}: {st.status}")
    for name, t in st.stages.items():
        if t.ms is not None:
            print(f"  {name:<8} {t.ms:9.1f} ms")
    for it in st.items:
        hit = "cache hit" if it.cache_hit else ("encoded" if it.encoded else "pending")
        print(f"  {it.modality} {it.mm_hash[:16]}  {hit}")
    if st.result is not None:
        print(f"  tokens: {st.result.token_ids}")
        if st.result.text is not None:
            print(f"  text:   {st.result.text!r}")
    if st.error is not None:
        rule = f" [{st.error.rule}]" if st.error.rule else ""
        print(f"  error:  {st.error.code}{rule}: {st.error.message}")


def _follow(client: Any, request_id: str, timeout_s: float) -> Any:
    """Print each status change to stderr (SSE) with its time since the first, from the times
    the server recorded (a finished request's history replays with its real stage times); then
    the final status."""
    t0 = time.monotonic()
    last = None
    first_ms: float | None = None
    try:
        for ev in client.events(request_id):
            at = ev.data.get("at_ms")
            if isinstance(at, int | float):
                first_ms = at if first_ms is None else first_ms
                elapsed = (at - first_ms) / 1000
            else:
                elapsed = time.monotonic() - t0
            if ev.status != last:
                print(f"  {elapsed:7.2f}s  {ev.status}", file=sys.stderr, flush=True)
                last = ev.status
            if time.monotonic() - t0 > timeout_s:
                break
    except Exception as exc:  # events are progress only; the long-poll below decides
        print(f"  (progress unavailable: {exc})", file=sys.stderr)
    return client.wait(request_id, timeout_s=max(1.0, timeout_s - (time.monotonic() - t0)))


def _stream(client: Any, request_id: str, timeout_s: float) -> Any:
    """Print the request's text on stdout as its tokens arrive (``token`` events), its status
    changes on stderr; then the final status. Should a token write have been lost, the rest of
    the final text is printed at the end, so stdout always holds the whole text."""
    from frontend.client import TokenEvent

    t0 = time.monotonic()
    shown: list[str] = []
    try:
        for ev in client.events(request_id, tokens=True):
            if isinstance(ev, TokenEvent):
                if ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    shown.append(ev.text)
            else:
                print(f"  {time.monotonic() - t0:7.2f}s  {ev.status}", file=sys.stderr, flush=True)
            if time.monotonic() - t0 > timeout_s:
                break
    except Exception as exc:  # the stream is a view; the long-poll below decides
        print(f"\n  (stream interrupted: {exc})", file=sys.stderr)
    st = client.wait(request_id, timeout_s=max(1.0, timeout_s - (time.monotonic() - t0)))
    text = (st.result.text if st.result else None) or ""
    streamed = "".join(shown)
    if text.startswith(streamed) and len(text) > len(streamed):
        sys.stdout.write(text[len(streamed) :])
    if shown or text:
        sys.stdout.write("\n")
    sys.stdout.flush()
    return st


def _print_outcome(st: Any) -> None:
    """One line on stderr: the outcome, the tokens made, the error."""
    made = len(st.result.token_ids) if st.result else 0
    line = f"request {st.request_id}: {st.status} ({made} tokens)"
    if st.error is not None:
        rule = f" [{st.error.rule}]" if st.error.rule else ""
        line += f"; {st.error.code}{rule}: {st.error.message}"
    print(line, file=sys.stderr)


def _run(args: argparse.Namespace, body: Any) -> int:
    import httpx

    from frontend.client import EPDError

    try:
        with _client(args) as client:
            return int(body(client))
    except EPDError as e:
        hint = ""
        if e.status == 401:
            hint = (
                " (give --token TOKEN or set EPD_API_TOKEN)"
                if not args.token
                else " (the API does not know this token)"
            )
        print(f"error: {e}{hint}", file=sys.stderr)
        return 1
    except (httpx.TransportError, OSError) as e:
        print(f"error: cannot reach the API at {args.url}: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_submit(args: argparse.Namespace) -> int:
    for p in args.image:
        if not p.is_file():
            print(f"error: no such image file: {p}", file=sys.stderr)
            return 1

    def body(client: Any) -> int:
        rid = client.submit(
            prompt=args.prompt,
            images=list(args.image),
            max_tokens=args.max_tokens,
            cache_salt=args.cache_salt,
            deadline_s=args.deadline_s,
            idempotency_key=args.idempotency_key,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
        if args.stream:
            print(f"submitted {rid}", file=sys.stderr)
            st = _stream(client, rid, args.timeout)
            if args.json:
                _print_status(st, True)
            else:
                _print_outcome(st)
            return 0 if st.status == "completed" else 1
        if not args.wait:
            print(json.dumps({"request_id": rid}) if args.json else rid)
            return 0
        print(f"submitted {rid}", file=sys.stderr)
        st = _follow(client, rid, args.timeout)
        _print_status(st, args.json)
        return 0 if st.status == "completed" else 1

    return _run(args, body)


def run_status(args: argparse.Namespace) -> int:
    if args.request_id is None:
        from epd.commands.fleet_status import run_fleet

        return run_fleet(args)

    def body(client: Any) -> int:
        st = _follow(client, args.request_id, args.timeout) if args.wait else None
        st = st or client.status(args.request_id)
        _print_status(st, args.json)
        if args.wait:
            return 0 if st.status == "completed" else 1
        return 0

    return _run(args, body)


def run_cancel(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        _print_status(client.cancel(args.request_id), args.json)
        return 0

    return _run(args, body)
