"""The sweep: requests nobody will finish end anyway, with a code that says why.

A request normally ends because a stage reports its outcome. Two things can leave one unfinished
for good: its events are gone from the broker (Tansu keeps everything in memory, so a restart
loses every record it held; an Apache Kafka topic deleted or truncated does the same), or every
stage that held it died past retrying. The results collector runs this sweep every
``EPD_SWEEP_INTERVAL_S`` over the unfinished requests (the in-flight set of the status store;
while it is empty the sweep backs off to ``EPD_SWEEP_IDLE_INTERVAL_S``, and the collector's
next folded update brings it back):

* **past its deadline** (by more than ``GRACE_MS``, so a stage that is still working reports its
  own ``expired`` with the tokens so far first): ``expired``, code ``deadline``;
* **its events are gone**: its record has not changed for ``EPD_SWEEP_STALE_S`` (longer than a
  producer retries a send, so an event still on its way is not taken for a lost one) and a
  stage that should have seen it has consumed everything on the partition its event went to
  (the group's committed offset is the partition's end: every record there was handled, and the
  loop commits only after a handler is done) without leaving a mark in the record: ``failed``, code
  ``broker-lost``. The prefill event is keyed by the request id, so its partition is known; the
  encode events are keyed by the items' hashes, which the record does not keep, so for them the
  whole encode topic must be consumed. With the decode stage (``EPD_DECODE_STAGE``), a request
  the prefill worker handed off (its record says so) and no decode worker reported on is judged
  the same way by the decode topic's partition (that event is keyed by the request id too).

Every request has a deadline (``EPD_REQUEST_TIMEOUT_S`` when the client gave none), so none can
hang. The outcome is written through to the record (the first terminal status wins, so a stage
that reports at the same moment is not overridden twice) and, when it changed the record, sent
on ``{prefix}.results`` like any stage's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from runtime.settings import Settings
from runtime.status import StatusGone, StatusStore
from schemas.status_record import HANDOFF_INFO, StatusRecord
from schemas.topics import Topics
from schemas.types import ErrorInfo, ResultEvent, now_ms

log = logging.getLogger(__name__)

GRACE_MS = 5000
"""How long past its deadline a request is left to the stage that holds it."""
SCAN_LIMIT = 10000
"""Unfinished requests looked at per sweep (the oldest first)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """How the sweep ends one request."""

    request_id: str
    status: str
    code: str
    message: str

    def event(self) -> ResultEvent:
        """The outcome as a stage update (stage ``sweep``)."""
        return ResultEvent(
            request_id=self.request_id,
            stage="sweep",
            status=self.status,
            error=ErrorInfo(self.code, self.message),
        )


@dataclass(frozen=True, slots=True)
class Progress:
    """What the stages' consumer groups have finished: per topic, the partitions whose committed
    offset is their end offset, and the topic's partition count."""

    idle: dict[str, frozenset[int]]
    partitions: dict[str, int]
    missing: frozenset[str] = frozenset()
    """Topics the broker no longer has at all: whatever was on them is gone."""

    def idle_for_key(self, topic: str, key: str) -> bool:
        """Whether the partition a record keyed ``key`` went to has been consumed to its end."""
        if topic in self.missing:
            return True
        count = self.partitions.get(topic, 0)
        if count == 0:
            return False
        parts = list(range(count))
        return DefaultPartitioner()(key.encode(), parts, parts) in self.idle.get(topic, ())

    def idle_topic(self, topic: str) -> bool:
        """Whether every partition of ``topic`` has been consumed to its end."""
        if topic in self.missing:
            return True
        count = self.partitions.get(topic, 0)
        return count > 0 and len(self.idle.get(topic, ())) == count


def judge(
    rec: StatusRecord,
    *,
    now: int,
    stale_ms: int,
    progress: Progress,
    topics: Topics,
) -> Verdict | None:
    """The sweep's verdict on one record, or None when it is not the sweep's to end (pure)."""
    if rec.terminal:
        return None
    rid = rec.request_id
    deadline = rec.deadline_ms
    if deadline is not None and now > deadline + GRACE_MS:
        return Verdict(
            rid,
            "expired",
            "deadline",
            f"no stage finished the request within its deadline ({now - deadline} ms ago); "
            "its events were still queued, or lost by the broker",
        )
    if now - int(rec.updated_ms or rec.created_ms or now) < stale_ms:
        return None
    if not rec.reached("fanout"):
        return None  # not on the encode/prefill topics yet: only its deadline can end it
    if not rec.reached("prefill") and progress.idle_for_key(topics.prefill, rid):
        return Verdict(
            rid,
            "failed",
            "broker-lost",
            "its prefill event is no longer on the broker: the prefill workers consumed their "
            "partition to its end without seeing it (a broker restart lost it?); resubmit",
        )
    if (
        rec.info.get(HANDOFF_INFO) == "decode"
        and not rec.reached("decode")
        and progress.idle_for_key(topics.decode, rid)
    ):
        return Verdict(
            rid,
            "failed",
            "broker-lost",
            "its decode event is no longer on the broker: the decode workers consumed their "
            "partition to its end without seeing it (a broker restart lost it?); resubmit",
        )
    if rec.items_pending() and progress.idle_topic(topics.encode):
        return Verdict(
            rid,
            "failed",
            "broker-lost",
            "an encode event of it is no longer on the broker: the encode workers consumed "
            "their topic to its end without encoding the item (a broker restart lost it?); "
            "resubmit",
        )
    return None


ProgressReader = Callable[[], Awaitable[Progress]]


class Sweeper:
    """Ends the requests :func:`judge` says nobody will finish; run it beside a results loop."""

    def __init__(
        self,
        settings: Settings,
        status: StatusStore,
        send: Callable[[ResultEvent], Awaitable[object]],
        progress: ProgressReader,
    ) -> None:
        self.settings = settings
        self.status = status
        self.send = send
        self.progress = progress
        self.topics = Topics(settings.topic_prefix)
        self.ended = 0
        self.passes = 0
        self.unfinished = 0
        """Unfinished requests the last pass found."""
        self._poked = asyncio.Event()

    async def sweep_once(self) -> list[Verdict]:
        """One pass: read the unfinished records, judge them, end the ones judged."""
        records = await self._unfinished()
        self.passes += 1
        self.unfinished = len(records)
        if not records:
            return []
        progress = await self.progress()
        now = now_ms()
        verdicts = [
            v
            for rec in records
            if (
                v := judge(
                    rec,
                    now=now,
                    stale_ms=int(self.settings.sweep_stale_s * 1000),
                    progress=progress,
                    topics=self.topics,
                )
            )
        ]
        for v in verdicts:
            ev = v.event()
            try:
                ended = await self.status.apply(ev)  # False: a stage ended it first
            except StatusGone:
                continue  # the record went since the scan: nothing is left to end
            if ended:
                self.ended += 1
                log.warning(
                    "sweep: request %s %s (%s): %s", v.request_id, v.status, v.code, v.message
                )
                await self.send(ev)
        return verdicts

    async def _unfinished(self) -> list[StatusRecord]:
        # An in-flight entry is counted at admission, its record made after the render (up
        # to EPD_API_RENDER_TIMEOUT_S): an entry without a record is an orphan only once it is
        # older than both together.
        s = self.settings
        orphan_ms = int((s.sweep_stale_s + s.api_render_timeout_s) * 1000)
        return await self.status.inflight.unfinished(
            SCAN_LIMIT, orphaned_before_ms=now_ms() - orphan_ms
        )

    def poke(self) -> None:
        """A request moved (the collector folded an update): a sweep backed off while nothing
        was unfinished comes back to ``EPD_SWEEP_INTERVAL_S``. Cheap: call it on every update."""
        self._poked.set()

    async def run(self) -> None:
        """Sweep every ``EPD_SWEEP_INTERVAL_S`` until cancelled; a failed pass is logged.

        A pass that found nothing unfinished doubles the wait before the next one, up to
        ``EPD_SWEEP_IDLE_INTERVAL_S``; a :meth:`poke` cuts a longer wait to the interval."""
        base = self.settings.sweep_interval_s
        interval = base
        while True:
            await self._pause(interval, base)
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis or the broker away: the next pass tries again
                log.warning("sweep failed: %r", exc)
                self.unfinished = 1  # unknown: keep the interval
            idle_max = max(base, self.settings.sweep_idle_interval_s)
            interval = base if self.unfinished else min(interval * 2, idle_max)

    async def _pause(self, interval: float, base: float) -> None:
        """Wait ``interval``; a poke during a longer wait ends it ``base`` after it began (or
        at once, when that has passed)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._poked.clear()
        if interval <= base:
            await asyncio.sleep(interval)
            return
        try:
            await asyncio.wait_for(self._poked.wait(), interval)
        except TimeoutError:
            return
        await asyncio.sleep(max(0.0, start + base - loop.time()))


def _consumed(committed: Any, end: int) -> bool:
    """Whether a group's committed offset (None or -1: nothing committed) reaches ``end``."""
    if end == 0:
        return True  # an empty partition: nothing there to handle
    return committed is not None and committed.offset >= end


class BrokerProgress:
    """Reads :class:`Progress` of the encode and prefill groups (and the decode group, with the
    decode stage) from the broker (admin API)."""

    def __init__(self, settings: Settings) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        from runtime.kafka import make_consumer

        self.topics = Topics(settings.topic_prefix)
        self.decode_stage = settings.decode_stage
        self._admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        self._offsets = make_consumer(settings, group_id=None)
        self._started = False

    async def _start(self) -> None:
        if not self._started:
            await self._admin.start()
            await self._offsets.start()
            self._started = True

    async def __call__(self) -> Progress:
        await self._start()
        idle: dict[str, frozenset[int]] = {}
        counts: dict[str, int] = {}
        missing: set[str] = set()
        stages = [("encode", self.topics.encode), ("prefill", self.topics.prefill)]
        if self.decode_stage:
            stages.append(("decode", self.topics.decode))
        for stage, topic in stages:
            described = await self._admin.describe_topics([topic])
            parts = [
                p["partition"]
                for d in described
                if not d.get("error_code")
                for p in d.get("partitions", [])
            ]
            counts[topic] = len(parts)
            if not parts:
                missing.add(topic)
                continue
            tps = [TopicPartition(topic, p) for p in parts]
            ends = await self._offsets.end_offsets(tps)
            committed = await self._admin.list_consumer_group_offsets(
                self.topics.group(stage), partitions=tps
            )
            idle[topic] = frozenset(
                tp.partition for tp in tps if _consumed(committed.get(tp), ends[tp])
            )
        return Progress(idle, counts, frozenset(missing))

    async def close(self) -> None:
        # The consumer is stopped even when it never started: aiokafka warns of an unclosed
        # one when it is collected (a worker that stops before its first sweep).
        with contextlib.suppress(Exception):
            await self._offsets.stop()
        if self._started:
            with contextlib.suppress(Exception):
                await self._admin.close()
