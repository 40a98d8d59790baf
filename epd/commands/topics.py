"""``epd topics create|list``: the seven pipeline topics on the configured broker."""

from __future__ import annotations

import argparse
import asyncio
import sys

from runtime.settings import Settings, get_settings
from schemas.topics import Topics


def _settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, with the CLI flags laid over them."""
    update: dict[str, object] = {}
    if args.bootstrap:
        update["kafka_bootstrap"] = args.bootstrap
    if args.prefix:
        update["topic_prefix"] = args.prefix
    return get_settings().model_copy(update=update)


def cmd_create(args: argparse.Namespace) -> int:
    """Create the missing topics with the configured partitions and ``max.message.bytes``."""
    from runtime.kafka import ensure_topics

    settings = _settings(args)
    if args.partitions is not None and args.partitions < 1:
        print("epd: error: --partitions must be >= 1", file=sys.stderr)
        return 2
    names = Topics(settings.topic_prefix).all()
    try:
        created = asyncio.run(
            ensure_topics(settings, names, partitions=args.partitions, timeout_s=args.timeout)
        )
    except Exception as exc:  # connection refused, timeout, broker error: say which broker
        print(
            f"epd: error: cannot create topics on {settings.kafka_bootstrap}: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    for name in names:
        print(f"{name}\t{'created' if name in created else 'exists'}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """List the broker's topics that carry the configured prefix."""
    from aiokafka.admin import AIOKafkaAdminClient

    settings = _settings(args)

    async def names() -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        await asyncio.wait_for(admin.start(), args.timeout)
        try:
            return sorted(await admin.list_topics())
        finally:
            await admin.close()

    try:
        found = asyncio.run(names())
    except Exception as exc:
        print(f"epd: error: cannot reach {settings.kafka_bootstrap}: {exc}", file=sys.stderr)
        return 1
    for name in found:
        if name.startswith(f"{settings.topic_prefix}."):
            print(name)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``topics create`` and ``topics list`` to the CLI."""
    topics = sub.add_parser("topics", help="create or list the pipeline's Kafka topics")
    actions = topics.add_subparsers(dest="topics_command", metavar="ACTION", required=True)
    for name, func, text in (
        ("create", cmd_create, "create the seven topics (missing ones only)"),
        ("list", cmd_list, "list the topics under the prefix"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("--bootstrap", default=None, help="override EPD_KAFKA_BOOTSTRAP")
        p.add_argument("--prefix", default=None, help="override EPD_TOPIC_PREFIX")
        p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the broker")
        if name == "create":
            p.add_argument(
                "--partitions", type=int, default=None, help="default EPD_TOPIC_PARTITIONS"
            )
        p.set_defaults(func=func)
