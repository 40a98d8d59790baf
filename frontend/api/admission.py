"""Admission at the API: a connected broker, the encoders' backlog, the in-flight bound.

The encode topic's consumer lag is sampled in the background: asking the broker on every
request would put two admin round trips on the submit path, and a sample a second old is good
enough to tell "the encoders are far behind" from "they are not". It is sampled once at start,
then every second only while requests come (an API nobody calls asks the broker nothing): the
first request after a quiet spell is judged without a sample (none is fresh) and wakes the
sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from producers.refusal import Refused
from runtime.kafka import make_consumer
from runtime.settings import Settings
from runtime.status import StatusStore
from schemas.topics import Topics

log = logging.getLogger(__name__)


async def _close(consumer: AIOKafkaConsumer, admin: AIOKafkaAdminClient) -> None:
    with contextlib.suppress(Exception):
        await consumer.stop()
    with contextlib.suppress(Exception):
        await admin.close()


def consumer_lag(end: dict[TopicPartition, int], committed: dict[TopicPartition, int]) -> int:
    """Events not yet consumed: per partition, end offset minus committed (0 if none)."""
    return sum(max(0, e - committed.get(tp, 0)) for tp, e in end.items())


FRESH_S = 10.0
"""How long a lag sample is trusted (and sampled for after the last admission that asked)."""


class LagMonitor:
    """Keeps ``lag`` (events behind on the encode topic for the encode group) fresh."""

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        interval_s: float = 1.0,
        idle_after_s: float = FRESH_S,
    ) -> None:
        self.settings = settings
        self.topic = topics.encode
        self.group = topics.group("encode")
        self.interval_s = interval_s
        self.idle_after_s = idle_after_s
        """With no admission asked for this long, sampling stops until one does."""
        self.lag: int | None = None
        self.sampled_at = 0.0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None
        self._asked = asyncio.Event()
        self._asked_at = time.monotonic()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="encode-lag")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def sample(self, consumer: AIOKafkaConsumer, admin: AIOKafkaAdminClient) -> int:
        """One measurement: end offsets minus the encode group's committed offsets. The
        consumer never joins the group (no subscription), it only reads its offsets; the
        topic's partitions come from the admin client (public metadata)."""
        described = await admin.describe_topics([self.topic])
        parts = sorted(
            p["partition"]
            for d in described
            if d.get("topic") == self.topic and not d.get("error_code")
            for p in d.get("partitions", [])
        )
        tps = [TopicPartition(self.topic, p) for p in parts]
        if not tps:
            return 0
        end = await consumer.end_offsets(tps)
        committed = {}
        for tp in tps:
            off = await consumer.committed(tp)
            if off is not None:
                committed[tp] = off
        return consumer_lag(end, committed)

    async def _run(self) -> None:
        clients: tuple[AIOKafkaConsumer, AIOKafkaAdminClient] | None = None
        try:
            while True:
                try:
                    clients = clients or await self._connect()
                    self.lag = await self.sample(*clients)
                    self.sampled_at = time.monotonic()
                    self.samples += 1
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # broker down: keep the last sample; start afresh
                    log.debug("encode lag sample failed: %s", exc)
                    if clients is not None:
                        await _close(*clients)
                    clients = None
                await self._until_next()
        finally:
            if clients is not None:
                await _close(*clients)

    async def _connect(self) -> tuple[AIOKafkaConsumer, AIOKafkaAdminClient]:
        consumer = make_consumer(self.settings, group_id=self.group)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        try:
            await consumer.start()
            await admin.start()
        except BaseException:
            await _close(consumer, admin)
            raise
        return consumer, admin

    async def _until_next(self) -> None:
        """``interval_s``, then, when no admission asked for ``idle_after_s``, until one does."""
        await asyncio.sleep(self.interval_s)
        if time.monotonic() - self._asked_at > self.idle_after_s:
            self._asked.clear()
            await self._asked.wait()

    def over(self, limit: int) -> bool:
        """True when a recent sample (under :data:`FRESH_S` old) is above ``limit`` (0 disables:
        nothing is sampled for it). Asking keeps the sampler going."""
        if limit <= 0:
            return False
        self._asked_at = time.monotonic()
        self._asked.set()
        if self.lag is None:
            return False
        return time.monotonic() - self.sampled_at < FRESH_S and self.lag > limit


class ApiAdmission:
    """The API's :class:`producers.intake.Admission`: refuses while the broker is not connected
    (``unavailable``), while the encoders lag more than ``EPD_API_MAX_ENCODE_LAG`` events, and
    once ``EPD_API_MAX_IN_FLIGHT`` requests are unfinished across all replicas (``throttled``)."""

    def __init__(
        self,
        settings: Settings,
        status: StatusStore,
        lag: LagMonitor,
        kafka_ready: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.status = status
        self.lag = lag
        self.kafka_ready = kafka_ready

    async def admit(self, request_id: str) -> None:
        """Count ``request_id`` in flight, or raise ``Refused``."""
        s = self.settings
        if not self.kafka_ready.is_set():
            raise Refused(
                "unavailable",
                "Kafka is not connected yet",
                rule="kafka",
                retry_after_s=s.api_retry_after_s,
            )
        if self.lag.over(s.api_max_encode_lag):
            raise Refused(
                "throttled",
                f"the encoders are {self.lag.lag} events behind (limit {s.api_max_encode_lag})",
                rule="admission.encode_lag",
                retry_after_s=spread(s.api_retry_after_s),
            )
        if not await self.status.admit(request_id, s.api_max_in_flight):
            raise Refused(
                "throttled",
                f"{s.api_max_in_flight} requests are in flight",
                rule="admission.in_flight",
                retry_after_s=spread(s.api_retry_after_s),
            )

    async def release(self, request_id: str) -> None:
        """Give the in-flight slot back."""
        await self.status.release(request_id)


def spread(base_s: int) -> int:
    """A ``Retry-After`` between ``base_s`` and twice it: clients throttled in one burst are
    told different times, so they do not all come back in the same second."""
    return random.randint(max(1, base_s), 2 * max(1, base_s))
