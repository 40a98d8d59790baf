"""The engine seam of the prefill worker: what computes an admitted request (``EPD_ENGINE``).

Everything around the compute stays the worker's (admission, the embedding wait, status,
cancel, deadlines, the DLQ, metrics); a :class:`PrefillBackend` only turns an admitted request
and its items into a :class:`~gpu_workers.generation.Generation`. Two implementations:

* :class:`ReferenceBackend` (``transformers``, the default): this project's engine, the
  request decoding in the worker's batch (:class:`~gpu_workers.generation.Generator`).
* :class:`~gpu_workers.vllm_engine.generation.VllmGenerator` (``vllm``): the request handed to a
  vLLM instance's ``/inference/v1/generate``; vLLM's EC connector reads the embeddings the
  encode stage parked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from gpu_workers.generation import Generator
from gpu_workers.instant import engine_for

if TYPE_CHECKING:
    from gpu_workers.compute import ItemEmbedding
    from gpu_workers.context import WorkerContext
    from gpu_workers.engine import DecodeEngine
    from gpu_workers.generation import Generation
    from gpu_workers.lifecycle.record_watch import RecordWatch
    from runtime.reporting import RequestUpdates
    from runtime.token_stream import TokenStreams
    from schemas.types import PrefillEvent


class PrefillBackend(Protocol):
    """Prefill + decode of one admitted request, its tokens streamed as they come."""

    async def generate(
        self, ev: PrefillEvent, items: list[ItemEmbedding], updates: RequestUpdates
    ) -> Generation:
        """``ev`` generated to its end (or stopped: cancel, deadline, record gone)."""
        ...

    async def close(self) -> None:
        """Release the engine (threads, connections)."""
        ...


class ReferenceBackend:
    """This project's engine: the prompt and its embeddings prefilled, then decoded in the
    worker's batch on its compute thread."""

    def __init__(self, engine: DecodeEngine, generator: Generator) -> None:
        self.engine = engine
        self.generator = generator

    async def generate(
        self, ev: PrefillEvent, items: list[ItemEmbedding], updates: RequestUpdates
    ) -> Generation:
        engine = self.engine
        return await self.generator.run(ev, lambda: engine.prefill(ev.token_ids, items), updates)

    async def close(self) -> None:
        await self.engine.close()


class VllmBackend:
    """vLLM's ``/inference/v1/generate`` (``EPD_VLLM_PREFILL_URL``); the items' embeddings are
    not sent: vLLM's EC connector fetches them by the request's ``ec_transfer_params``."""

    def __init__(self, ctx: WorkerContext, watch: RecordWatch, streams: TokenStreams | None):
        from gpu_workers.vllm_engine.client import VllmClient
        from gpu_workers.vllm_engine.generation import VllmGenerator

        s = ctx.settings
        urls = s.vllm_urls("prefill")
        if not urls:
            raise ValueError("EPD_ENGINE=vllm needs EPD_VLLM_PREFILL_URL (the vLLM instances)")
        if s.decode_stage:
            raise ValueError(
                "EPD_ENGINE=vllm runs prefill and decode in the vLLM instance: unset "
                "EPD_DECODE_STAGE (vLLM's own P/D connectors split them there)"
            )
        self.client = VllmClient.for_settings(urls, s)
        self.generator = VllmGenerator(ctx, self.client, watch, streams=streams)

    async def generate(
        self, ev: PrefillEvent, items: list[ItemEmbedding], updates: RequestUpdates
    ) -> Generation:
        return await self.generator.run(ev, updates)

    async def close(self) -> None:
        await self.client.close()


def prefill_backend(
    ctx: WorkerContext, watch: RecordWatch, streams: TokenStreams | None
) -> PrefillBackend:
    """The backend ``EPD_ENGINE`` names."""
    if ctx.settings.engine == "vllm":
        return VllmBackend(ctx, watch, streams)
    engine = engine_for(ctx.settings, ctx.bundle)
    return ReferenceBackend(engine, Generator(ctx, engine, watch, streams=streams))
