"""Run the results worker in this process, feed it, and report what it loaded (JSON on stdout).

``python -m tests.lean_probe`` with the test services' ``EPD_*`` settings in the environment
(``tests/unit/test_lean_workers.py`` starts it). It runs the worker as ``epd worker results``
does (the command line's modules imported, :func:`epd.stages.run_worker`: topics, publisher,
status store, the sweep, the consume loop); once the worker holds its partitions it sends one
stage update and one item's encoded mark through the broker, waits until the collector has
folded both into the request's status record, then prints which model libraries this process
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
import uuid

import epd.cli  # noqa: F401  (what `epd worker` imports before the stage runs)
from epd.stages import run_worker
from runtime.kafka import KafkaPublisher
from runtime.publisher import publish
from runtime.redis.client import redis_client
from runtime.settings import Settings
from runtime.status import StatusStore
from schemas.topics import Topics
from schemas.types import EncodedEvent, ResultEvent

MODEL_LIBRARIES = ("torch", "transformers")
WAIT_S = 60.0


def rss_mb() -> float:
    """This process's resident set (``VmRSS``), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def feed(settings: Settings, report: dict[str, object]) -> None:
    """One request's record, a stage update and an encoded mark through the broker; waits
    until the running worker folded both, then reports and stops the worker."""
    topics = Topics(settings.topic_prefix)
    client = redis_client(settings)
    status = StatusStore.for_settings(client, settings)
    publisher = KafkaPublisher.for_pipeline(settings, topics)
    rid = f"lean-{uuid.uuid4().hex[:12]}"
    try:
        await publisher.start()
        await status.start(ResultEvent(rid, "router", "queued"))
        await publish(publisher, topics, ResultEvent(rid, "fanout", "encoding"))
        mark = EncodedEvent("ab" * 32, rid, "tiny", "local://x", "k", "float32", [4, 8])
        await publish(publisher, topics, mark)
        deadline = time.monotonic() + WAIT_S
        record = await status.get(rid)
        while not (record and record.status == "encoding" and len(record.stages) >= 3):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the collector did not fold the updates: {record}")
            await asyncio.sleep(0.1)
            record = await status.get(rid)
        report["stages"] = sorted(record.stages)
        report["info"] = record.info
        report["modules"] = sorted(m for m in MODEL_LIBRARIES if m in sys.modules)
        report["rss_mb"] = round(rss_mb(), 1)
        await status.delete(rid)
    finally:
        await publisher.stop()
        await client.aclose()
        os.kill(os.getpid(), signal.SIGTERM)  # the worker drains, commits and returns


async def main() -> dict[str, object]:
    settings = Settings()
    report: dict[str, object] = {}
    tasks: list[asyncio.Task[None]] = []

    async def ready() -> None:
        tasks.append(asyncio.create_task(feed(settings, report)))

    await run_worker("results", settings, ready=ready)
    for task in tasks:
        await task  # its failure fails the probe
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
