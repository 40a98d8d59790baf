"""Writing dead letters: the consume loop's last word on a record it cannot handle.

A record over ``EPD_MAX_MESSAGE_BYTES``, undecodable bytes, a permanent error or retries run out:
the record runner hands it to :class:`DeadLetterWriter`, which publishes a ``DeadLetter`` (the
original topic/partition/offset/key/value/headers plus the error, with ``epd-error-*`` Kafka
headers: :mod:`schemas.dead_letters`) to the DLQ topic, and only then lets the record's offset
count as done. The stage's own report (a ``rejected`` status) follows through ``on_dead_letter``.
:mod:`~consumers.dead_letters.reader` reads them back.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from consumers.metrics import ConsumerMetrics
from consumers.records import ConsumedEvent, DeadLetterHook
from consumers.retry import backoff_delay
from consumers.stopping import Abandoned, sleep_unless_stopping
from runtime.publisher import frame
from schemas import dead_letters as envelope
from schemas.types import DeadLetter, ErrorInfo

log = logging.getLogger(__name__)

__all__ = ["DeadLetterWriter"]


class DeadLetterWriter:
    """Publishes one consume loop's dead letters to ``dlq_topic``.

    ``in_transaction``: the sends ride in the loop's Kafka transaction, so a broker error
    abandons the record (its batch is aborted and delivered again) instead of being retried.
    """

    def __init__(
        self,
        *,
        group_id: str,
        dlq_topic: str,
        stop: asyncio.Event,
        metrics: ConsumerMetrics,
        backoff_initial_s: float,
        backoff_max_s: float,
        in_transaction: bool = False,
        on_dead_letter: DeadLetterHook | None = None,
    ) -> None:
        self.group_id = group_id
        self.dlq_topic = dlq_topic
        self.producer: AIOKafkaProducer | None = None
        """The started producer to send with (set by the loop when it starts)."""
        self.dead_lettered = 0
        self._stop = stop
        self._metrics = metrics
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._in_transaction = in_transaction
        self._on_dead_letter = on_dead_letter

    async def write(self, ce: ConsumedEvent, info: ErrorInfo, *, attempts: int) -> None:
        """Publish ``ce``'s dead letter (retrying until the broker takes it), then run the hook.

        Raises :class:`~consumers.stopping.Abandoned` when the loop stops meanwhile (or, in a
        transaction, the send failed): the record's offset must then stay uncommitted."""
        group = self.group_id
        original = envelope.Original(
            ce.topic, ce.partition, ce.offset, ce.key, ce.value, ce.headers
        )
        letter = envelope.dead_letter(original, info, attempts=attempts, group=group)
        self._metrics.errors.labels(group, info.code, info.rule or "").inc()
        log.warning(
            "%s: dead-lettering %s[%d]@%d after %d attempt(s): %s %s",
            group,
            ce.topic,
            ce.partition,
            ce.offset,
            attempts,
            info.code,
            info.message,
        )
        await self._publish(letter, ce.key)
        self.dead_lettered += 1
        self._metrics.dead_lettered.labels(group).inc()
        await self._report(ce, info)

    async def _publish(self, letter: DeadLetter, key: bytes | None) -> None:
        """Send ``letter`` until the broker takes it: one too large loses its payload (still in
        the source topic at its offset); a broker error is retried (the offset must not be
        committed without its dead letter), or, in a transaction, abandons the batch."""
        assert self.producer is not None, "the loop sets the producer when it starts"
        failures = 0
        while True:
            try:
                record = frame(letter, key, headers=envelope.envelope_headers(letter))
                await self.producer.send_and_wait(
                    self.dlq_topic, value=record.value, key=record.key, headers=record.headers
                )
                return
            except MessageSizeTooLargeError:
                if not letter.value:
                    raise
                letter = envelope.without_value(letter)
            except KafkaError as exc:
                if self._in_transaction:
                    # The transaction may be unusable now: abort the batch, deliver it again.
                    log.warning("%s: DLQ publish failed in a transaction (%r)", self.group_id, exc)
                    raise Abandoned from exc
                failures += 1
                delay = backoff_delay(failures, *self._backoff)
                log.warning(
                    "%s: DLQ publish failed (%r); retry in %.2fs", self.group_id, exc, delay
                )
                await sleep_unless_stopping(self._stop, delay)

    async def _report(self, ce: ConsumedEvent, info: ErrorInfo) -> None:
        """The worker's own report of a dead letter (a ``rejected`` status); its failure is
        logged, never raised: the dead letter is out."""
        if self._on_dead_letter is None:
            return
        try:
            await self._on_dead_letter(ce, info)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: on_dead_letter hook failed", self.group_id)
