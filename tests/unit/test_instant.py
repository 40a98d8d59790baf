"""The instant engine (``EPD_MODEL=instant``): the whole real path with no model compute.

A request runs through the real stages (render, fan-out, encode with its store entry, prefill
admission and embedding wait, the decode batch, results) on the in-memory broker, and ends with
the instant engine's deterministic tokens; with the decode stage on, the zero KV cache is parked
and restored for real. The engine keeps the real engine's bounds and stops.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from epd.stages import StageContext
from gpu_workers.compute import tokens_for_grid
from gpu_workers.engine import DecodeJob, new_sequence
from gpu_workers.instant import INSTANT_TEXT, InstantEngine, engine_for, instant_encode
from media.sample_images import synthetic_image
from producers.render import Renderer
from runtime.memory_broker import InMemoryBroker
from runtime.model import load_model, load_render_info
from runtime.settings import Settings
from schemas.errors import ComputeError
from schemas.topics import Topics
from schemas.types import RenderEvent, SamplingParams
from tests.memory_stages import Stages, memory_stages

MAX_TOKENS = 9


def instant_answer(n: int) -> list[int]:
    return [INSTANT_TEXT[i % len(INSTANT_TEXT)] for i in range(n)]


def test_instant_bundle_has_the_tiny_shapes_no_weights_and_its_own_fingerprint() -> None:
    instant, tiny = load_model("instant", device="cpu"), load_model("tiny", device="cpu")
    assert instant.instant and not tiny.instant and instant.model is None
    assert instant.fingerprint != tiny.fingerprint  # zero embeddings never meet real ones
    for name in ("vocab_size", "context_length", "merge_size", "image_token_id", "eos_token_id"):
        assert getattr(instant, name) == getattr(tiny, name), name
    assert load_render_info("instant").fingerprint == instant.fingerprint


def test_instant_encode_gives_the_towers_shapes_and_checks_pixels() -> None:
    bundle = load_model("instant", device="cpu")
    grid = torch.tensor([1, 4, 6])
    out = instant_encode(bundle, [(torch.zeros(24, 1176), grid)])
    assert out[0]["embeds"].shape == (tokens_for_grid(grid, 2), 64)
    with pytest.raises(ComputeError, match="does not match grid"):
        instant_encode(bundle, [(torch.zeros(23, 1176), grid)])


async def test_instant_engine_batches_and_stops_like_the_real_one() -> None:
    bundle = load_model("instant", device="cpu")
    settings = Settings(decode_max_batch=4)
    engine = engine_for(settings, bundle)
    assert isinstance(engine, InstantEngine)
    stop_after: set[str] = set()

    async def one(i: int) -> tuple[str, list[int]]:
        rid = f"r{i}"
        seq = new_sequence(bundle, SamplingParams(max_tokens=MAX_TOKENS + i), rid)
        job = DecodeJob(
            rid,
            seq,
            lambda: engine.prefill([65] * (3 + i), []),
            kv_tokens=3 + i + MAX_TOKENS + i,
            should_stop=lambda: rid in stop_after,
        )
        done = await engine.run(job)
        return done.outcome, seq.tokens

    stop_after.add("r7")
    results = await asyncio.gather(*(one(i) for i in range(8)))
    await engine.close()
    for i, (outcome, tokens) in enumerate(results):
        if i == 7:
            assert outcome == "cancelled"
            continue
        assert outcome == "completed" and tokens == instant_answer(MAX_TOKENS + i)
    assert engine.largest_batch == 4  # EPD_DECODE_MAX_BATCH holds


def test_instant_prefill_checks_the_prompt() -> None:
    engine = engine_for(Settings(), load_model("instant", device="cpu"))
    with pytest.raises(ComputeError, match="empty"):
        engine.prefill([], [])
    with pytest.raises(ComputeError):
        engine.prefill([10**6], [])


@pytest.fixture(params=[False, True], ids=["prefill-decodes", "decode-stage"])
async def instant_stages(
    request: pytest.FixtureRequest, settings: Settings, redis_prefix: str
) -> AsyncIterator[Stages]:
    async with memory_stages(
        settings, redis_prefix, model="instant", decode_stage=request.param
    ) as stages:
        yield stages


async def test_a_request_runs_every_real_stage_on_the_instant_engine(
    instant_stages: tuple[InMemoryBroker, StageContext, Topics],
) -> None:
    broker, ctx, topics = instant_stages
    info = load_render_info("instant")
    ev: RenderEvent = Renderer(info, max_image_pixels=4096 * 4096).render(
        uuid.uuid4().hex,
        prompt="Describe <image>.",
        images=[synthetic_image(84, 56, seed=3)],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1),
    )
    await broker.send(topics.render, ev.request_id, ev)
    await broker.drain()
    record = await ctx.status_store().get(ev.request_id)
    assert record is not None and record.status == "completed", record
    assert record.token_ids == instant_answer(MAX_TOKENS)
    assert record.text == INSTANT_TEXT[:MAX_TOKENS].decode()
    assert len(broker.events(topics.encode)) == 1  # the encode stage ran for real
    if ctx.settings.decode_stage:
        assert len(broker.events(topics.decode)) == 1  # the zero KV cache was parked


def test_a_placeholder_that_is_not_all_pads_is_refused_before_prefill() -> None:
    from gpu_workers.compute import item_embedding

    bundle = load_model("instant", device="cpu")
    engine = engine_for(Settings(), bundle)
    pad = bundle.image_token_id
    item = item_embedding(
        "image", 1, 4, {"embeds": torch.zeros(4, 64)}, {"image_grid_thw": torch.tensor([1, 4, 4])}
    )
    assert engine.prefill([65, pad, pad, pad, pad, 66], [item]).prompt_len == 6
    with pytest.raises(ComputeError, match="pad tokens of the placeholder"):
        engine.prefill([65, pad, pad, 67, pad, 66], [item])
