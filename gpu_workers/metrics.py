"""Prometheus series of the encode stage: encoder-cache hits and misses, bytes in and out.

The consume loop already counts records, errors by rule, latency, in-flight and lag for every
stage; these are what only the encode worker knows. One set per registry (the worker passes the
process registry its ``--metrics-port`` serves; tests get private, unregistered series).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from runtime.metrics import per_registry


class EncodeMetrics:
    """``epd_encode_items_total{outcome=hit|miss}`` (hit ratio = hit / (hit + miss)),
    ``epd_encode_bytes_in_total`` (claim-checked encoder inputs read from the store) and
    ``epd_encode_bytes_out_total`` (encoder outputs written to the store)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.items = Counter(
            "epd_encode_items",
            "Encode events by encoder-cache outcome",
            ["outcome"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "epd_encode_bytes_in", "Claim-checked encoder input bytes read", registry=registry
        )
        self.bytes_out = Counter(
            "epd_encode_bytes_out", "Encoder output bytes written to the store", registry=registry
        )


def encode_metrics(registry: CollectorRegistry | None) -> EncodeMetrics:
    """The encode series of ``registry`` (created once per registry), or private ones."""
    return per_registry(EncodeMetrics, registry)
