"""A transactional consume loop in its own process, for tests/integration/test_transactions.py.

``python -m tests.integration.txn_worker IN OUT GROUP MARKER``: copies every record of IN to OUT
(same key and value) through the loop's transactional producer. With ``EPD_TEST_HANG=1`` the
handler of a record whose value is ``hang`` first sends its output, then touches MARKER and waits
until a file ``MARKER.release`` appears (or for ever): the test kills the process there,
mid-transaction, or lets a newer incarnation fence it and then releases it. Settings come from
``EPD_*``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from consumers.config import ConsumerConfig
from consumers.loop import ConsumeLoop
from consumers.records import ConsumedEvent
from runtime.kafka import make_transactional_producer, start_producer, transactional_id
from runtime.settings import Settings


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.1)


async def main(src: str, out: str, group: str, marker: Path) -> None:
    settings = Settings()
    producer = make_transactional_producer(settings, transactional_id(settings, group))
    await start_producer(producer, settings)
    hang = os.environ.get("EPD_TEST_HANG") == "1"

    async def handler(ce: ConsumedEvent) -> None:
        await producer.send_and_wait(out, value=ce.value, key=ce.key)
        if hang and ce.value == b"hang":
            await asyncio.to_thread(marker.write_text, "sent\n")
            # The release comes from another process, as a file: wait for it in a thread.
            await asyncio.to_thread(_wait_for, marker.with_name(marker.name + ".release"))

    config = ConsumerConfig(topics=[src], group_id=group, dlq_topic=f"{src}.dlq")
    loop = ConsumeLoop(settings, config, handler, decode=lambda b: b, producer=producer)
    try:
        await loop.run_until_signal()
    finally:
        await producer.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
