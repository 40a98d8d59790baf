"""A request through fan-out, encode and prefill on the in-memory broker, with the real stages.

The router, encode, prefill and results handlers are the ones ``epd worker`` runs (built from
``epd.stages.STAGES`` with the same context), the model is the tiny one, the store is
``local://``, the status records live in the test Redis; only Kafka is replaced, by
:class:`runtime.memory_broker.InMemoryBroker`, which frames every record as for Kafka and hands
it, decoded again, to the stages subscribed to its topic. Seconds, not a broker and processes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from epd.stages import StageContext
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from media.sample_images import synthetic_image
from producers.render import Renderer
from runtime.memory_broker import InMemoryBroker
from runtime.model import load_model
from runtime.settings import Settings
from schemas.codec import SCHEMA_HEADER
from schemas.topics import Topics
from schemas.types import EncodeEvent, PrefillEvent, RenderEvent, SamplingParams
from tests.memory_stages import Stages
from tests.memory_stages import memory_stages as stages_in_memory

MAX_TOKENS = 6


@pytest.fixture
async def memory_stages(settings: Settings, redis_prefix: str) -> AsyncIterator[Stages]:
    """Every stage's handler subscribed to its topics on one in-memory broker."""
    async with stages_in_memory(settings, redis_prefix, model="tiny") as stages:
        yield stages


async def test_one_request_runs_fan_out_encode_and_prefill_in_memory(
    memory_stages: tuple[InMemoryBroker, StageContext, Topics],
) -> None:
    broker, ctx, topics = memory_stages
    bundle = load_model("tiny", device="cpu")
    image = synthetic_image(84, 56, seed=3)
    ev: RenderEvent = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        uuid.uuid4().hex,
        prompt="Describe <image>.",
        images=[image],
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
    )
    await broker.send(topics.render, ev.request_id, ev)  # as an external renderer would
    await broker.drain()

    record = await ctx.status_store().get(ev.request_id)
    assert record is not None and record.status == "completed", record
    ids, pixels, grid = monolithic_inputs(ev)
    want = generate_monolithic(bundle, ids, pixels, grid, MAX_TOKENS)
    assert record.token_ids == want  # the disaggregated path, to the token
    # Each stage's records went out framed as for Kafka, on the topic the channel table says.
    (encode,) = broker.events(topics.encode)
    (prefill,) = broker.events(topics.prefill)
    assert isinstance(encode, EncodeEvent) and isinstance(prefill, PrefillEvent)
    assert prefill.features.kwargs_data is None  # metadata only on the prefill topic
    assert [r.key for r in broker.on(topics.encode)] == [encode.mm_hash]
    assert all(dict(r.headers)[SCHEMA_HEADER] for r in broker.records)
    assert {e.status for e in broker.events(topics.results)} >= {"encoding", "completed"}
