"""Topic names (prefix configurable) and the consumer group names that read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topics:
    """The seven topics of one pipeline, under one prefix."""

    prefix: str = "epd"

    @property
    def render(self) -> str:
        return f"{self.prefix}.render"

    @property
    def encode(self) -> str:
        return f"{self.prefix}.encode"

    @property
    def prefill(self) -> str:
        return f"{self.prefix}.prefill"

    @property
    def decode(self) -> str:
        """Requests handed from prefill workers to decode workers (the optional decode stage)."""
        return f"{self.prefix}.decode"

    @property
    def encoded(self) -> str:
        return f"{self.prefix}.encoded"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def all(self) -> list[str]:
        return [
            self.render,
            self.encode,
            self.prefill,
            self.decode,
            self.encoded,
            self.results,
            self.dlq,
        ]

    def group(self, stage: str) -> str:
        """Consumer group of a stage, e.g. ``epd-encode``. The prefix is part of it, so two
        pipelines sharing one broker never join each other's groups (a shared group would
        rebalance across both on every join)."""
        return f"{self.prefix}-{stage}"
