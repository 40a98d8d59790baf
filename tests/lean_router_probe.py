"""Run the render router in this process, route real render events, and report what it loaded
(JSON on stdout).

``python -m tests.lean_router_probe EVENTS_FILE`` with the test services' ``EPD_*`` settings in
the environment (``tests/unit/test_lean_workers.py`` starts it). ``EVENTS_FILE`` holds encoded
RenderEvents (a renderer made them, in the test's process: rendering needs the model), each as
a 4-byte big-endian length and the event's bytes. The worker runs as ``epd worker router`` does
(the command line's modules imported, :func:`epd.stages.run_worker`); once it holds its
partitions the events are sent to the render topic as they are, and once the router has made
every request's record (its fan-out's update) this process prints which model libraries it
imported and its resident memory, and stops the worker as SIGTERM would.

Kept apart from the test module so that nothing but the worker's own imports (no pytest) counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import epd.cli  # noqa: F401  (what `epd worker` imports before the stage runs)
from epd.stages import run_worker
from runtime.kafka import KafkaPublisher
from runtime.publisher import publish
from runtime.redis.client import redis_client
from runtime.settings import Settings
from runtime.status import StatusStore
from schemas.codec import wire_codec
from schemas.topics import Topics
from schemas.types import RenderEvent
from tests.lean_probe import MODEL_LIBRARIES, rss_mb

WAIT_S = 90.0


def read_events(path: Path) -> list[bytes]:
    """The length-prefixed encoded events of ``path``."""
    data = path.read_bytes()
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


async def feed(settings: Settings, events: list[bytes], report: dict[str, object]) -> None:
    """Send the render events as they are; wait until the router recorded each request's
    fan-out, then report and stop the worker."""
    topics = Topics(settings.topic_prefix)
    client = redis_client(settings)
    status = StatusStore.for_settings(client, settings)
    publisher = KafkaPublisher.for_pipeline(settings, topics)
    try:
        await publisher.start()
        rids = []
        for value in events:
            ev = wire_codec().decode(value, RenderEvent)  # for its topic and key; no torch
            await publish(publisher, topics, ev, value=value)
            rids.append(ev.request_id)
        stages: dict[str, list[str]] = {}
        deadline = time.monotonic() + WAIT_S
        while len(stages) < len(rids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not route {sorted(set(rids) - set(stages))}")
            await asyncio.sleep(0.1)
            for rid in rids:
                record = await status.get(rid)
                if record is not None and any(s.startswith("fanout:") for s in record.stages):
                    stages[rid] = sorted(record.stages)
        report["stages"] = stages
        report["modules"] = sorted(m for m in MODEL_LIBRARIES if m in sys.modules)
        report["rss_mb"] = round(rss_mb(), 1)
    finally:
        await publisher.stop()
        await client.aclose()
        os.kill(os.getpid(), signal.SIGTERM)  # the worker drains, commits and returns


async def main(path: Path) -> dict[str, object]:
    settings = Settings()
    events = read_events(path)
    report: dict[str, object] = {}
    tasks: list[asyncio.Task[None]] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(feed(settings, events, report)))

    await run_worker("router", settings, ready=ready)
    for task in tasks:
        await task  # its failure fails the probe
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
