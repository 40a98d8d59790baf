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
