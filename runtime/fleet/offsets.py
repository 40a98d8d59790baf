"""Lag per consumer group and partition, and the dead letters retained, read from the broker.

The API measures them itself (a consumer that joins no group, and the admin client): the figures
then exist while a stage has no worker at all, which is when an operator needs them most.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.topics import STAGE_NAMES

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from runtime.settings import Settings
    from schemas.topics import Topics


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition of one group's topic."""

    group: str
    topic: str
    partition: int
    end: int
    committed: int | None
    """The group's committed offset (None: it committed nothing here yet)."""
    lag: int
    """Records behind: end - committed (end - beginning without a commit)."""


@dataclass(frozen=True, slots=True)
class Offsets:
    """What the broker says of the pipeline's groups and its DLQ."""

    lag: tuple[PartitionLag, ...]
    dlq_records: dict[str, int]


class OffsetReader:
    """Reads :class:`Offsets` through its own clients, connected on first use and remade after
    a failure."""

    def __init__(self, settings: Settings, topics: Topics, timeout_s: float = 5.0) -> None:
        self.settings = settings
        self.topics = topics
        self.timeout_s = timeout_s
        self._clients: tuple[AIOKafkaConsumer, AIOKafkaAdminClient] | None = None
        self._group_consumers: dict[str, AIOKafkaConsumer] = {}
        self._lock = asyncio.Lock()
        """One read at a time: a scrape and an admin call share the clients."""

    async def read(self) -> Offsets:
        """The offsets now (raises what the broker raised: the caller reports it)."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._read(), self.timeout_s)
            except BaseException:
                await self.close()
                raise

    async def _read(self) -> Offsets:
        consumer, admin = self._clients or await self._connect()
        tps = await _partitions(admin, self.topics.all())
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        lag: list[PartitionLag] = []
        for stage in STAGE_NAMES:
            group = self.topics.group(stage)
            read = [tp for tp in tps if tp.topic in self.topics.read_by(stage)]
            committed = await self._committed(group, read)
            lag.extend(_group_lag(group, read, begin, end, committed))
        dlq = self.topics.dlq
        return Offsets(tuple(lag), {dlq: sum(end[t] - begin[t] for t in tps if t.topic == dlq)})

    async def _committed(self, group: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed offsets, asked through a consumer of that group that never
        joins it (the offset fetch every broker here answers; Tansu garbles the admin's)."""
        from runtime.kafka import make_consumer

        consumer = self._group_consumers.get(group)
        if consumer is None:
            consumer = make_consumer(self.settings, group_id=group)
            self._group_consumers[group] = consumer
            await consumer.start()
        offsets = await asyncio.gather(*(consumer.committed(tp) for tp in tps))
        return {tp: off for tp, off in zip(tps, offsets, strict=True) if off is not None}

    async def _connect(self) -> tuple[AIOKafkaConsumer, AIOKafkaAdminClient]:
        from runtime.kafka import make_consumer

        consumer = make_consumer(self.settings, group_id=None)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        self._clients = (consumer, admin)
        await consumer.start()
        await admin.start()
        return consumer, admin

    async def close(self) -> None:
        """Close the clients (the next read connects again)."""
        clients, self._clients = self._clients, None
        groups, self._group_consumers = self._group_consumers, {}
        for member in groups.values():
            with contextlib.suppress(Exception):
                await member.stop()
        if clients is None:
            return
        consumer, admin = clients
        with contextlib.suppress(Exception):
            await consumer.stop()
        with contextlib.suppress(Exception):
            await admin.close()


async def _partitions(admin: AIOKafkaAdminClient, topics: list[str]) -> list[TopicPartition]:
    described = await admin.describe_topics(topics)
    return sorted(
        TopicPartition(d["topic"], p["partition"])
        for d in described
        if not d.get("error_code")
        for p in d.get("partitions", [])
    )


def _group_lag(
    group: str,
    tps: list[TopicPartition],
    begin: dict[TopicPartition, int],
    end: dict[TopicPartition, int],
    committed: dict[TopicPartition, int],
) -> list[PartitionLag]:
    out = []
    for tp in tps:
        done = committed.get(tp)
        base = begin[tp] if done is None else max(done, begin[tp])
        out.append(
            PartitionLag(group, tp.topic, tp.partition, end[tp], done, max(0, end[tp] - base))
        )
    return out
