"""Prometheus series of the consume loops, labelled by consumer group."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.metrics import per_registry

__all__ = ["ConsumerMetrics", "metrics_for"]


class ConsumerMetrics:
    """Prometheus series for consume loops, labelled by consumer group."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        labels = ["group"]
        self.processed = Counter(
            "epd_consumer_processed", "Records handled successfully", labels, registry=registry
        )
        self.retried = Counter(
            "epd_consumer_retried",
            "Handler retries after transient failures",
            labels,
            registry=registry,
        )
        self.dead_lettered = Counter(
            "epd_consumer_dead_lettered", "Records sent to the DLQ", labels, registry=registry
        )
        self.in_flight = Gauge(
            "epd_consumer_in_flight", "Handlers running now", labels, registry=registry
        )
        self.paused = Counter(
            "epd_consumer_backpressure_pauses",
            "Times the loop paused fetching at max_in_flight",
            labels,
            registry=registry,
        )
        self.handler_seconds = Histogram(
            "epd_consumer_handler_seconds",
            "Handler wall time per attempt",
            labels,
            registry=registry,
        )
        self.errors = Counter(
            "epd_consumer_errors",
            "Dead-lettered records by error code and validation rule",
            ["group", "code", "rule"],
            registry=registry,
        )
        self.lag = Gauge(
            "epd_consumer_lag",
            "Records behind the partition's end (high watermark - position)",
            ["group", "topic", "partition"],
            registry=registry,
        )


def metrics_for(registry: CollectorRegistry | None) -> ConsumerMetrics:
    """The series in ``registry`` (None: a private one, for tests)."""
    # One set per registry: several loops (encode + prefill in one process) share series.
    return per_registry(ConsumerMetrics, registry)
