"""``epd dlq list|show|replay``: inspect the dead-letter topic and replay what can be replayed.

The logic lives in :mod:`consumers.dead_letters` (its reader and replay); this module parses
flags, connects, and prints (a table or, with ``--json``, JSON). Exit codes: 0 done, 1 nothing at
that position, 2 bad arguments or a broker/Redis that cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from runtime.settings import Settings, get_settings

if TYPE_CHECKING:
    from consumers.dead_letters.reader import DeadLetterRecord, LetterFilter

MESSAGE_WIDTH = 80


def _settings(args: argparse.Namespace) -> Settings:
    update: dict[str, object] = {}
    if args.bootstrap:
        update["kafka_bootstrap"] = args.bootstrap
    if args.prefix:
        update["topic_prefix"] = args.prefix
    return get_settings().model_copy(update=update)


def _filter(args: argparse.Namespace) -> LetterFilter:
    from consumers.dead_letters.reader import LetterFilter, parse_since

    since = parse_since(args.since) if args.since else None
    return LetterFilter(since_ms=since, rule=args.rule, code=args.code)


def _json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


async def _with_ledger(settings: Settings, body: Callable[[Any], Awaitable[int]]) -> int:
    from consumers.dead_letters.replay import ReplayLedger
    from runtime.redis.client import redis_client

    client = redis_client(settings)
    try:
        return await body(
            ReplayLedger(client, prefix=settings.topic_prefix, ttl_s=settings.dlq_replay_ttl_s)
        )
    finally:
        await client.aclose()


async def _annotate(ledger: Any, records: list[DeadLetterRecord]) -> None:
    """Replay state from the ledger; listing still works (without it) when Redis does not."""
    from redis.exceptions import RedisError

    try:
        await ledger.annotate(records)
    except (RedisError, OSError) as exc:
        print(f"epd: warning: replay state unknown (Redis: {exc})", file=sys.stderr)


def _row(r: DeadLetterRecord) -> str:
    from consumers.dead_letters.reader import describe

    d = describe(r)
    if r.letter is None:
        return f"{r.position:<8} {d['failed'][:19]}  <undecodable DLQ record: {r.decode_error}>"
    e = r.letter.error
    where = " ".join(
        f"{n}={v}" for n, v in (("modality", e.modality), ("item", e.item)) if v is not None
    )
    state = "replayed" if r.replayed_ms is not None else ""
    if r.replayed_from is not None:
        state = f"replay#{r.replay_count}-failed"
    msg = e.message.replace("\n", " ")
    if len(msg) > MESSAGE_WIDTH:
        msg = msg[: MESSAGE_WIDTH - 3] + "..."
    return (
        f"{r.position:<8} {d['failed'][:19]}  {r.source:<28} {e.code:<17} {e.rule or '-':<22} "
        f"{where or '-':<20} {r.letter.attempts:>3}  {state or '-':<16} {msg}"
    )


async def list_letters(settings: Settings, args: argparse.Namespace) -> int:
    """Print the dead letters that match the filters, oldest first."""
    from consumers.dead_letters.reader import describe, read_dead_letters
    from schemas.topics import Topics

    records = await read_dead_letters(settings, Topics(settings.topic_prefix).dlq, _filter(args))

    async def body(ledger: Any) -> int:
        await _annotate(ledger, records)
        if args.json:
            _json([describe(r) for r in records])
            return 0
        print(
            f"{'POS':<8} {'FAILED (UTC)':<20} {'SOURCE':<28} {'CODE':<17} {'RULE':<22} "
            f"{'WHERE':<20} {'TRY':>3}  {'REPLAY':<16} MESSAGE"
        )
        for r in records:
            print(_row(r))
        print(f"{len(records)} dead letter(s)")
        return 0

    return await _with_ledger(settings, body)


async def show_letter(settings: Settings, args: argparse.Namespace) -> int:
    """Print one dead letter in full (headers and the original event's identity, no tensors)."""
    from consumers.dead_letters.reader import (
        NotFound,
        describe,
        fetch_dead_letter,
        parse_position,
    )
    from schemas.topics import Topics

    partition, offset = parse_position(args.position)
    topic = Topics(settings.topic_prefix).dlq
    try:
        rec = await fetch_dead_letter(settings, topic, partition, offset)
    except NotFound as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 1

    async def body(ledger: Any) -> int:
        await _annotate(ledger, [rec])
        d = describe(rec, with_value=True)
        if args.json:
            _json(d)
            return 0
        for name, value in d.items():
            if isinstance(value, dict):
                print(f"{name}:")
                for k, v in value.items():
                    print(f"  {k}: {v}")
            else:
                print(f"{name}: {value}")
        return 0

    return await _with_ledger(settings, body)


async def replay_letters(settings: Settings, args: argparse.Namespace) -> int:
    """Re-validate and republish the matching dead letters; print one line per dead letter."""
    from consumers.dead_letters.reader import read_dead_letters
    from consumers.dead_letters.replay import Replayer, outcome_line
    from runtime.kafka import make_producer
    from runtime.processor_limits import deployment_tensor_limit
    from runtime.stores import open_store
    from schemas.topics import Topics
    from schemas.validator import ValidationConfig

    topics = Topics(settings.topic_prefix)
    records = await read_dead_letters(settings, topics.dlq, _filter(args))
    # The limit the workers apply (derived from the model's processor), so a record they would
    # accept is not refused here.
    limit = await asyncio.to_thread(deployment_tensor_limit, settings)
    config = ValidationConfig.from_settings(settings, mode="strict", max_tensor_bytes=limit)

    async def body(ledger: Any) -> int:
        producer = None if args.dry_run else make_producer(settings)
        store = open_store(settings.embedding_store_url)
        try:
            if producer is not None:
                await producer.start()
            outcomes = await Replayer(topics, config, ledger, producer, store).replay(
                records, dry_run=args.dry_run
            )
        finally:
            if producer is not None:
                await producer.stop()
            await store.close()
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[o.action] = counts.get(o.action, 0) + 1
        if args.json:
            _json({"outcomes": [o.describe() for o in outcomes], "counts": counts})
            return 0
        for o in outcomes:
            print(outcome_line(o))
        summary = ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "nothing to replay"
        print(f"{'dry run: ' if args.dry_run else ''}{summary}")
        return 0

    return await _with_ledger(settings, body)


def _run(
    func: Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]],
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        settings = _settings(args)
        try:
            return asyncio.run(func(settings, args))
        except ValueError as exc:  # --since, POSITION
            print(f"epd: error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # broker or Redis unreachable: name them, no traceback
            print(
                f"epd: error: dlq {args.dlq_command} failed ({type(exc).__name__}: {exc}); "
                f"broker {settings.kafka_bootstrap}, redis {settings.redis_url}",
                file=sys.stderr,
            )
            return 2

    return run


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``dlq list``, ``dlq show`` and ``dlq replay`` to the CLI."""
    dlq = sub.add_parser("dlq", help="list, show and replay dead letters")
    actions = dlq.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    p_list = actions.add_parser("list", help="the dead letters, oldest first")
    p_show = actions.add_parser("show", help="one dead letter in full")
    p_show.add_argument("position", metavar="OFFSET|PARTITION:OFFSET", help="position in the DLQ")
    p_replay = actions.add_parser(
        "replay",
        help="re-validate dead letters and republish them to their original topics",
        description="Each matching dead letter's original event is decoded and re-validated; "
        "undecodable, still-invalid, expired and already-replayed records are skipped with the "
        "reason. A record that was replayed and dead-lettered again is never replayed again.",
    )
    p_replay.add_argument("--dry-run", action="store_true", help="check only, publish nothing")
    for p in (p_list, p_replay):
        p.add_argument("--since", help="failed since: a duration (15m, 2h, 7d) or an ISO time")
        p.add_argument("--rule", help="only dead letters whose error names this rule")
        p.add_argument("--code", help="only this error code (validation, retries_exhausted, ...)")
    for p, func in ((p_list, list_letters), (p_show, show_letter), (p_replay, replay_letters)):
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--bootstrap", default=None, help="override EPD_KAFKA_BOOTSTRAP")
        p.add_argument("--prefix", default=None, help="override EPD_TOPIC_PREFIX")
        p.set_defaults(func=_run(func))
