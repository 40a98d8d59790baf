"""Prometheus series of the fleet view: what the API measures of the whole pipeline at scrape
time (live workers per stage, lag per consumer group and partition, dead letters, store memory).

They come from the broker and Redis, not from the workers' own ``/metrics``, so they exist while
a stage has no worker at all: the case an operator most needs them for (a stage scaled to zero
or crashed, its lag growing).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

__all__ = ["FleetMetrics"]


class FleetMetrics:
    """The fleet series, in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.workers = Gauge(
            "epd_fleet_workers",
            "workers announcing themselves, by stage (an announcement lives EPD_FLEET_TTL_S)",
            ["stage"],
            registry=registry,
        )
        self.mismatched = Gauge(
            "epd_fleet_mismatched_workers",
            "live workers that disagree with this API, by stage and reason (ec_secret: another "
            "EC secret; model: another model; settings: other shared settings)",
            ["stage", "reason"],
            registry=registry,
        )
        self.group_lag = Gauge(
            "epd_group_lag",
            "records behind per consumer group and partition (end offset - committed offset), "
            "measured from the broker: present with no consumer running",
            ["group", "topic", "partition"],
            registry=registry,
        )
        self.dlq_records = Gauge(
            "epd_dlq_records",
            "records retained in the dead-letter topic (end - beginning offsets)",
            ["topic"],
            registry=registry,
        )
        self.store_used = Gauge(
            "epd_store_used_bytes",
            "memory the embedding store's Redis uses (summed over a cluster's masters)",
            registry=registry,
        )
        self.store_max = Gauge(
            "epd_store_max_bytes",
            "the embedding store's memory limit (Redis maxmemory; 0: none set)",
            registry=registry,
        )
