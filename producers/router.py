"""Render router: RenderEvents from external renderers -> fan-out to encode and prefill."""

from __future__ import annotations

from producers.fanout import FanOut
from schemas.types import RenderEvent


class RenderRouter:
    """Consumes ``epd.render`` and publishes each request's fan-out; plug into a ConsumeLoop."""

    def __init__(self, fanout: FanOut) -> None:
        self.fanout = fanout
        self.routed = 0

    async def handle(self, ev: RenderEvent) -> None:
        """Fan one rendered request out (validation errors go to the DLQ via the loop)."""
        await self.fanout.publish(ev)
        self.routed += 1
