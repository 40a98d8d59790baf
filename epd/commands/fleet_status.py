"""``epd status`` (no request id): the fleet (workers per stage, lag per group and partition,
dead letters, requests by status) and whether the pipeline can serve, from Redis and the broker."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.fleet.snapshot import FleetSnapshot
    from runtime.settings import Settings


def run_fleet(args: argparse.Namespace) -> int:
    """``epd status`` without a request id: the fleet snapshot, as text or ``--json``."""
    from runtime.settings import get_settings

    settings = get_settings()
    snap = asyncio.run(_snapshot(settings, kafka=not args.no_kafka))
    if args.json:
        json.dump(snap.to_dict(), sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        from runtime.fleet.render import render_snapshot

        print(render_snapshot(snap, settings.required_stages))
    if "redis" in snap.errors:
        return 2
    return 0 if not snap.causes else 1


async def _snapshot(settings: Settings, *, kafka: bool) -> FleetSnapshot:
    from runtime.fleet.snapshot import FleetProbe, expected_as_configured
    from runtime.redis.client import redis_client
    from runtime.status import StatusStore
    from schemas.topics import Topics

    client = redis_client(settings, socket_connect_timeout=2.0)
    status = StatusStore.for_settings(client, settings)
    topics = Topics(settings.topic_prefix)
    probe = FleetProbe(settings, topics, status, expected_as_configured(settings))
    try:
        return await probe.snapshot(kafka=kafka)
    finally:
        await probe.close()
        await client.aclose()
