"""One record, start to finish: size check, decode, trace span, handler, retries, dead letter.

:class:`RecordRunner` holds no consumer and commits nothing: the consume loop hands it a fetched
record and learns one thing back, whether the record's offset may now count as done (handled, or
its dead letter acknowledged) or not (abandoned because the loop is stopping).

* **Oversize.** A record over ``EPD_MAX_MESSAGE_BYTES`` is dead-lettered unread (code
  ``oversize``): Kafka hands out a batch larger than the fetch limit rather than stall, so such a
  record arrives anyway, and the limit is what every stage sizes its memory by.
* **Retries.** A transient failure (:func:`~consumers.retry.default_is_transient`) is retried
  with jittered exponential backoff (:class:`~consumers.retry.RetryPolicy`): a store or broker
  outage (:func:`~consumers.retry.default_is_infrastructure`) for ``transient_retry_s`` seconds
  from its first occurrence (never past the event's ``deadline_ms``), so a Redis restart of a few
  seconds sends nothing valid to the DLQ; any other error up to ``max_attempts`` tries.
* **Dead letters.** Undecodable bytes, a permanent error (``Poison``, ``ValidationError``,
  ``CodecError``) or a transient one that exhausted its attempts go to the
  :class:`~consumers.dead_letters.writer.DeadLetterWriter`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consumers.dead_letters.writer import DeadLetterWriter
from consumers.metrics import ConsumerMetrics
from consumers.records import ConsumedEvent, Handler, consumed_event
from consumers.retry import RetryPolicy, error_info
from consumers.stopping import Abandoned, sleep_unless_stopping
from runtime.tracing import carrier_of, stage_span
from schemas.types import ErrorInfo, now_ms

log = logging.getLogger(__name__)

__all__ = ["Classifier", "RecordRunner"]


@dataclass(frozen=True, slots=True)
class Classifier:
    """Which failures are worth a retry, and which of those are outages (time-budgeted)."""

    is_transient: Callable[[BaseException], bool]
    is_infrastructure: Callable[[BaseException], bool]


@dataclass(slots=True)
class _Failures:
    """One record's failures so far, as the retry policy weighs them: handler errors, and
    infrastructure outages timed from the first one."""

    handler: int = 0
    infrastructure: int = 0
    outage_began: float | None = None

    def count(self, *, permanent: bool, infrastructure: bool) -> None:
        if infrastructure:
            self.infrastructure += 1
            if self.outage_began is None:
                self.outage_began = time.monotonic()
        elif not permanent:
            self.handler += 1

    def outage_s(self) -> float:
        """How long the outage has lasted (0 when there was none)."""
        return time.monotonic() - self.outage_began if self.outage_began is not None else 0.0


def _deadline_left_s(event: Any) -> float | None:
    """Seconds until ``event``'s ``deadline_ms`` (negative once past; None if it has none)."""
    deadline = getattr(event, "deadline_ms", None)
    return (deadline - now_ms()) / 1000 if isinstance(deadline, int) else None


class RecordRunner:
    """Runs ``handler`` over one fetched record with the retry policy and dead letters."""

    def __init__(
        self,
        handler: Handler,
        *,
        group_id: str,
        decode: Callable[[bytes], Any],
        classify: Classifier,
        policy: RetryPolicy,
        dead_letters: DeadLetterWriter,
        max_message_bytes: int,
        stop: asyncio.Event,
        metrics: ConsumerMetrics,
    ) -> None:
        self.group_id = group_id
        self.dead_letters = dead_letters
        self.processed = 0
        self.retried = 0
        self._handler = handler
        self._decode = decode
        self._classify = classify
        self._policy = policy
        self._max_bytes = max_message_bytes
        self._stop = stop
        self._metrics = metrics

    async def run(self, rec: Any) -> bool:
        """Handle (or dead-letter) the fetched record ``rec``: True when its offset may count as
        done, False when it was abandoned (the loop is stopping) and must be delivered again."""
        ce = consumed_event(rec)
        try:
            if len(ce.value) > self._max_bytes:
                info = ErrorInfo(
                    "oversize",
                    f"record of {len(ce.value)} bytes exceeds "
                    f"EPD_MAX_MESSAGE_BYTES={self._max_bytes}",
                    field="value",
                )
                await self.dead_letters.write(ce, info, attempts=0)
            else:
                await self._decode_and_handle(ce)
        except Abandoned:
            return False
        return True

    async def _decode_and_handle(self, ce: ConsumedEvent) -> None:
        try:
            ce.event = self._decode(ce.value)
        except Exception as exc:
            await self.dead_letters.write(ce, error_info(exc, code="undecodable"), attempts=0)
            return
        carrier = carrier_of(getattr(ce.event, "trace", None), ce.headers)
        rid = getattr(ce.event, "request_id", None)
        with stage_span(
            self.group_id, carrier, request_id=rid or ce.key_str, produced_ms=ce.timestamp_ms
        ):
            await self._with_retries(ce)

    async def _with_retries(self, ce: ConsumedEvent) -> None:
        """Run the handler until it succeeds, or the retry policy gives up: then dead-letter."""
        failures = _Failures()
        attempt = 0
        while True:
            attempt += 1
            ce.attempt = attempt
            failure = await self._attempt(ce)
            if failure is None:
                return
            permanent = not self._classify.is_transient(failure)
            infrastructure = not permanent and self._classify.is_infrastructure(failure)
            failures.count(permanent=permanent, infrastructure=infrastructure)
            decision = self._policy.decide(
                permanent=permanent,
                infrastructure=infrastructure,
                handler_failures=failures.handler,
                infra_failures=failures.infrastructure,
                outage_s=failures.outage_s(),
                deadline_left_s=_deadline_left_s(ce.event),
            )
            if not decision.retry:
                info = error_info(failure, code=decision.code)
                await self.dead_letters.write(ce, info, attempts=ce.attempt)
                return
            self._log_retry(ce, failure, infrastructure, decision.delay_s)
            await sleep_unless_stopping(self._stop, decision.delay_s)

    async def _attempt(self, ce: ConsumedEvent) -> Exception | None:
        """One try of the handler: None when it succeeded, else what it failed with."""
        group = self.group_id
        started = time.perf_counter()
        try:
            await self._handler(ce)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # we are being cancelled (shutdown, revoke): the offset stays open
            # The handler re-raised someone else's cancellation (an awaited future that was
            # cancelled). Treat it as a failure; swallowing it would stall the partition's
            # commits forever.
            failure: Exception = RuntimeError(
                "handler raised CancelledError without being cancelled"
            )
        except Exception as exc:
            failure = exc
        else:
            elapsed = time.perf_counter() - started
            self._metrics.handler_seconds.labels(group).observe(elapsed)
            self.processed += 1
            self._metrics.processed.labels(group).inc()
            # DEBUG: a line per record is a JSON encode and a write per record, at every stage,
            # for what the handler-seconds and processed metrics already count.
            log.debug(
                "%s: handled %s[%d]@%d in %.1f ms",
                group,
                ce.topic,
                ce.partition,
                ce.offset,
                elapsed * 1000,
            )
            return None
        self._metrics.handler_seconds.labels(group).observe(time.perf_counter() - started)
        return failure

    def _log_retry(
        self, ce: ConsumedEvent, failure: Exception, infrastructure: bool, delay_s: float
    ) -> None:
        self.retried += 1
        self._metrics.retried.labels(self.group_id).inc()
        log.info(
            "%s: %s[%d]@%d attempt %d failed (%s%r); retrying in %.2fs",
            self.group_id,
            ce.topic,
            ce.partition,
            ce.offset,
            ce.attempt,
            "outage: " if infrastructure else "",
            failure,
            delay_s,
        )
