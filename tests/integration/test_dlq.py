"""``epd dlq`` against a real broker and Redis: dead letters written by a real ConsumeLoop, then
listed, shown and replayed, including a replay that fails again and is not looped."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers.config import ConsumerConfig
from consumers.dead_letters.reader import LetterFilter, fetch_dead_letter, read_dead_letters
from consumers.dead_letters.replay import Replayer, ReplayLedger
from consumers.loop import ConsumeLoop
from consumers.records import ConsumedEvent
from epd.cli import build_parser
from epd.commands import dlq as dlq_cmd
from runtime.kafka import KafkaPublisher, make_producer, topic_partitions
from runtime.redis.client import redis_client
from runtime.settings import Settings
from schemas.dead_letters import REPLAY_COUNT_HEADER, REPLAYED_FROM_HEADER
from schemas.topics import Topics
from schemas.types import Features, PlaceholderRange, PrefillEvent, ResultEvent
from schemas.validator import ValidationConfig, validate_prefill_event


class HandlerBug(Exception):
    """A handler error (not an outage): retried ``max_attempts`` times, then dead-lettered."""


pytestmark = pytest.mark.integration


async def _until(pred: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Wait for a condition (a cap against hangs, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred():
        if loop.time() > end:
            pytest.fail(f"gave up waiting for: {what}")
        await asyncio.sleep(0.02)


def _invalid_prefill() -> PrefillEvent:
    # Metadata-only image with no ec_transfer_params entry: the safety gate rejects it.
    grid = torch.tensor([[1, 4, 4]], dtype=torch.int64)
    return PrefillEvent(
        "bad-prefill",
        "tiny",
        list(range(10)),
        Features(
            {"image": ["h0"]},
            {"image": [PlaceholderRange(2, 4)]},
            None,
            {"image": [{"image_grid_thw": grid}]},
        ),
    )


async def _end_offsets(settings: Settings, topics: list[str]) -> dict[TopicPartition, int]:
    parts = await topic_partitions(settings, topics)
    tps = [TopicPartition(t, p) for t in topics for p in parts.get(t, [])]
    assert tps, f"no partitions found for {topics}"  # an empty answer would prove nothing
    c = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await c.start()
    try:
        return dict(await c.end_offsets(tps))
    finally:
        await c.stop()


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["dlq", *argv])


async def test_list_show_and_replay_without_loops(
    topic_settings: Settings, topics: Topics, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = topic_settings
    vconfig = ValidationConfig.from_settings(settings, mode="strict")
    seen_headers: dict[str, list[dict[str, bytes]]] = {}

    async def handler(ce: ConsumedEvent) -> None:
        ev = ce.event
        if isinstance(ev, PrefillEvent):
            validate_prefill_event(ev, vconfig)
            return
        seen_headers.setdefault(ev.request_id, []).append(ce.headers)
        if ev.request_id == "always-down":
            raise HandlerBug("always fails")
        if ev.request_id == "flaky" and REPLAYED_FROM_HEADER not in ce.headers:
            raise HandlerBug("fails until replayed")

    producer = make_producer(settings)
    await producer.start()
    try:
        for rid in ("ok", "flaky", "always-down"):
            await KafkaPublisher(producer).send(
                topics.results, rid, ResultEvent(rid, "test", "completed")
            )
        await producer.send_and_wait(topics.results, value=b"\x00not-avro", key=b"garbage")
        await KafkaPublisher(producer).send(topics.prefill, "bad-prefill", _invalid_prefill())
    finally:
        await producer.stop()

    config = ConsumerConfig(
        topics=[topics.results, topics.prefill],
        group_id=f"g-{uuid.uuid4().hex[:8]}",
        dlq_topic=topics.dlq,
        max_attempts=2,
        backoff_initial_s=0.01,
        backoff_max_s=0.02,
        commit_interval_s=0.05,
        poll_timeout_ms=100,
        consumer_overrides={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
    )
    loop = ConsumeLoop(settings, config, handler)
    task = asyncio.create_task(loop.run_forever())
    client = redis_client(settings)
    ledger = ReplayLedger(client, prefix=settings.topic_prefix, ttl_s=60)
    try:
        await _until(lambda: loop.dead_lettered == 4 and loop.processed == 1, "4 DLQ + 1 ok")

        # --- list: every dead letter with its coordinates and error ---------------------
        letters = await read_dead_letters(settings, topics.dlq)
        by_code = {r.letter.error.code: r for r in letters if r.letter is not None}
        assert sorted(by_code) == ["retries_exhausted", "undecodable", "validation"]
        assert len(letters) == 4
        invalid = by_code["validation"].letter
        assert invalid is not None
        assert (invalid.original_topic, invalid.key, invalid.attempts) == (
            topics.prefill,
            b"bad-prefill",
            1,
        )
        assert (invalid.error.rule, invalid.error.modality, invalid.error.item) == (
            "ec-transfer-required",
            "image",
            0,
        )
        exhausted = [r for r in letters if r.letter and r.letter.error.code == "retries_exhausted"]
        assert {r.letter.key for r in exhausted if r.letter} == {b"flaky", b"always-down"}
        assert all(r.letter and r.letter.attempts == 2 for r in exhausted)
        assert all("HandlerBug" in r.letter.error.message for r in exhausted if r.letter)

        await dlq_cmd.list_letters(settings, _args("list", "--json"))
        listed = json.loads(capsys.readouterr().out)
        assert len(listed) == 4
        row = next(d for d in listed if d["error"]["code"] == "validation")
        assert row["original_topic"] == topics.prefill and row["key"] == "bad-prefill"
        assert row["error"]["rule"] == "ec-transfer-required" and row["error"]["item"] == 0
        await dlq_cmd.list_letters(settings, _args("list", "--rule", "ec-transfer-required"))
        text = capsys.readouterr().out
        assert "ec-transfer-required" in text and "1 dead letter(s)" in text
        await dlq_cmd.list_letters(settings, _args("list", "--since", "1h", "--json"))
        assert len(json.loads(capsys.readouterr().out)) == 4
        await dlq_cmd.list_letters(settings, _args("list", "--since", "2999-01-01T00:00Z"))
        assert "0 dead letter(s)" in capsys.readouterr().out

        # Listing does not need Redis (only the replay state does).
        no_redis = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
        assert await dlq_cmd.list_letters(no_redis, _args("list")) == 0
        captured = capsys.readouterr()
        assert "4 dead letter(s)" in captured.out and "replay state unknown" in captured.err

        # --- show: by PARTITION:OFFSET, and by OFFSET alone when it is unambiguous --------
        pos = by_code["validation"]
        one = await fetch_dead_letter(settings, topics.dlq, pos.partition, pos.offset)
        assert one.letter == pos.letter
        await dlq_cmd.show_letter(settings, _args("show", pos.position, "--json"))
        shown = json.loads(capsys.readouterr().out)
        assert shown["event"] == {
            "type": "PrefillEvent",
            "request_id": "bad-prefill",
            "model": "tiny",
        }
        assert shown["error"]["rule"] == "ec-transfer-required"
        assert shown["headers"]["epd-error-rule"] == "ec-transfer-required"
        assert await dlq_cmd.show_letter(settings, _args("show", f"{pos.partition}:999")) == 1
        assert "no dead letter at offset 999" in capsys.readouterr().err
        holders = [r.partition for r in letters if r.offset == pos.offset]
        if len(holders) == 1:
            alone = await fetch_dead_letter(settings, topics.dlq, None, pos.offset)
            assert alone.letter == pos.letter
        else:
            assert await dlq_cmd.show_letter(settings, _args("show", str(pos.offset))) == 1
            assert "exists in several partitions" in capsys.readouterr().err

        # --- dry run: says what it would do, publishes nothing ----------------------------
        sources = [topics.results, topics.prefill]
        before = await _end_offsets(settings, sources)
        replayer = Replayer(topics, vconfig, ledger, None)
        dry = {o.record.position: o for o in await replayer.replay(letters, dry_run=True)}
        assert await _end_offsets(settings, sources) == before
        actions = {
            (o.record.letter.key if o.record.letter else None): (o.action, o.reason)
            for o in dry.values()
        }
        assert actions[b"flaky"] == ("would-replay", None)
        assert actions[b"always-down"] == ("would-replay", None)
        action, reason = actions[b"garbage"]
        assert action == "skipped" and reason is not None and reason.code == "undecodable"
        action, reason = actions[b"bad-prefill"]
        assert action == "skipped" and reason is not None
        assert (reason.code, reason.rule, reason.modality, reason.item) == (
            "still-invalid",
            "ec-transfer-required",
            "image",
            0,
        )

        # --- replay: the two transient failures go back; flaky succeeds, always-down fails
        # again and comes back to the DLQ marked as a replay ------------------------------
        assert await dlq_cmd.replay_letters(settings, _args("replay")) == 0
        out = capsys.readouterr().out
        assert "2 replayed, 2 skipped" in out
        assert "still-invalid rule=ec-transfer-required modality=image item=0" in out
        await _until(lambda: loop.processed == 2 and loop.dead_lettered == 5, "replays handled")
        replayed = seen_headers["flaky"][-1]
        origin = next(r for r in letters if r.letter and r.letter.key == b"flaky")
        assert replayed[REPLAYED_FROM_HEADER] == f"{topics.dlq}:{origin.position}".encode()
        assert replayed[REPLAY_COUNT_HEADER] == b"1"
        assert not any(k.startswith("epd-error-") for k in replayed)

        again = await read_dead_letters(
            settings, topics.dlq, LetterFilter(code="retries_exhausted")
        )
        failed_again = [r for r in again if r.replayed_from is not None]
        assert [r.letter.key for r in failed_again if r.letter] == [b"always-down"]
        assert failed_again[0].replay_count == 1

        # --- a second replay republishes nothing: the replayed dead letters are in the ledger,
        # and the one that failed after its replay is refused (no loop) ----------------------
        before = await _end_offsets(settings, sources)
        outcomes = await Replayer(topics, vconfig, ledger, None).replay(
            await read_dead_letters(settings, topics.dlq), dry_run=True
        )
        assert await _end_offsets(settings, sources) == before
        assert all(o.action == "skipped" for o in outcomes)
        reasons = sorted(o.reason.code for o in outcomes if o.reason)
        assert reasons == [
            "already-replayed",
            "already-replayed",
            "replay-failed-again",
            "still-invalid",
            "undecodable",
        ]
        assert await dlq_cmd.replay_letters(settings, _args("replay", "--json")) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["counts"] == {"skipped": 5}
        assert await _end_offsets(settings, sources) == before
        await dlq_cmd.list_letters(settings, _args("list"))
        table = capsys.readouterr().out
        assert "replay#1-failed" in table and table.count("replayed") >= 2
    finally:
        await loop.stop()
        await task
        keys = [k async for k in client.scan_iter(match=f"{settings.topic_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
