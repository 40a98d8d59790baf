"""A :class:`~runtime.fleet.snapshot.FleetSnapshot` onto the fleet's Prometheus series."""

from __future__ import annotations

from runtime.fleet.metrics import FleetMetrics
from runtime.fleet.readiness import MODEL_STAGES
from runtime.fleet.snapshot import FleetSnapshot
from schemas.topics import STAGE_NAMES

REASONS = ("ec_secret", "model", "settings")


def export_fleet(metrics: FleetMetrics, snap: FleetSnapshot) -> None:
    """Set every series from ``snap``. Series whose part could not be read keep their last
    value, except the per-partition lag, which is replaced as a whole (partitions come and go)."""
    if "redis" not in snap.errors:
        for stage in STAGE_NAMES:
            metrics.workers.labels(stage).set(len(snap.fleet.by_stage(stage)))
            for reason in REASONS:
                if reason == "model" and stage not in MODEL_STAGES:
                    continue
                count = sum(
                    1 for m in snap.mismatched if m["stage"] == stage and m["reason"] == reason
                )
                metrics.mismatched.labels(stage, reason).set(count)
    if snap.offsets is not None:
        metrics.group_lag.clear()
        for p in snap.offsets.lag:
            metrics.group_lag.labels(p.group, p.topic, str(p.partition)).set(p.lag)
        for topic, records in snap.offsets.dlq_records.items():
            metrics.dlq_records.labels(topic).set(records)
    if snap.store is not None:
        metrics.store_used.set(snap.store.used_bytes)
        metrics.store_max.set(snap.store.max_bytes)
