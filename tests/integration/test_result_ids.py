"""Results-topic records carry ``epd-result-id`` on a real broker (what downstream dedupes on)."""

from __future__ import annotations

import pytest

from runtime.kafka import KafkaPublisher, read_topic
from runtime.reporting import ResultReporter
from runtime.settings import Settings
from schemas.topics import Topics

pytestmark = pytest.mark.integration


async def test_result_id_header_reaches_the_results_topic(
    topic_settings: Settings, topics: Topics
) -> None:
    pub = KafkaPublisher.for_pipeline(topic_settings, topics)
    await pub.start()
    try:
        await ResultReporter(pub, topics.results, "prefill", "w")("r1", "completed")
    finally:
        await pub.stop()
    [rec] = await read_topic(topic_settings, topics.results)
    assert dict(rec.headers)["epd-result-id"] == b"r1:prefill:completed"
    assert dict(rec.headers)["epd-schema"] == b"epd.ResultEvent"


async def test_updates_sent_together_reach_the_topic_in_their_order(
    topic_settings: Settings, topics: Topics
) -> None:
    """``ResultReporter.many`` over a real broker: the records are queued in order and
    acknowledged together; the topic holds them in that order, each with its own result id."""
    from schemas.codec import get_codec

    pub = KafkaPublisher.for_pipeline(topic_settings, topics)
    await pub.start()
    statuses = ["prefilling", "decoding", "completed"]
    try:
        await ResultReporter(pub, topics.results, "prefill", "w").many(
            "r2", [(s, {}) for s in statuses]
        )
    finally:
        await pub.stop()
    records = await read_topic(topic_settings, topics.results)
    assert [get_codec().decode(r.value).status for r in records] == statuses
    assert [dict(r.headers)["epd-result-id"] for r in records] == [
        f"r2:prefill:{s}".encode() for s in statuses
    ]
