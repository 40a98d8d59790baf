"""Workers honour a cancel (DELETE /v1/requests/{id}): the encode worker skips the item before
reading or encoding anything, the prefill worker skips compute, the decode loop stops between
steps. Real broker, real Redis, the tiny model in-process."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from gpu_workers.compute import prefill
from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from gpu_workers.engine import CANCELLED, decode_alone, generate_from_embeddings
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from gpu_workers.prefill import PrefillWorker
from media.sample_images import synthetic_image
from producers.fanout import FanOut
from producers.render import Renderer
from runtime.kafka import KafkaPublisher, make_producer, read_topic
from runtime.model import ModelBundle, load_model
from runtime.settings import Settings
from runtime.status import CancelWatch, StatusStore
from runtime.stores.redis import RedisStore
from schemas.codec import decode
from schemas.errors import ValidationError
from schemas.types import ResultEvent, SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture
async def env(topic_settings: Settings) -> AsyncIterator[dict[str, Any]]:
    ns = f"ec-cancel-{uuid.uuid4().hex[:8]}"
    cfg = topic_settings.model_copy(
        update={"ec_namespace": ns, "ec_secret": SecretStr("s"), "store_url": ""}
    )
    client = aioredis.Redis.from_url(cfg.redis_url)
    store = RedisStore(cfg.redis_url)
    producer = KafkaPublisher(make_producer(cfg))
    await producer.start()
    watch = CancelWatch(client, cfg.topic_prefix)
    await watch.start()
    try:
        yield {
            "cfg": cfg,
            "store": store,
            "producer": producer,
            "watch": watch,
            "status": StatusStore(client, prefix=cfg.topic_prefix, ttl_s=60),
        }
    finally:
        await watch.close()
        await producer.stop()
        await store.close()
        keys = [k async for k in client.scan_iter(match=f"{cfg.topic_prefix}:*")]
        keys += [k async for k in client.scan_iter(match=f"{ns}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def _results(cfg: Settings, rid: str) -> list[ResultEvent]:
    recs = await read_topic(cfg, f"{cfg.topic_prefix}.results")
    return [e for e in (decode(r.value) for r in recs) if e.request_id == rid]


async def _planned(
    env: dict[str, Any], bundle: ModelBundle, seed: int, prompt: str = "Skip <image>"
) -> tuple[Any, Any]:
    """A one-image request rendered and planned by the real fan-out (nothing encoded yet)."""
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        f"req-{uuid.uuid4().hex[:8]}",
        prompt=prompt,
        images=[synthetic_image(56, 56, seed=seed)],
        sampling=SamplingParams(max_tokens=4),
    )
    return ev, await FanOut(env["cfg"], env["store"], bundle.render_info()).plan(ev)


async def _cancelled_plan(env: dict[str, Any], bundle: ModelBundle, seed: int) -> tuple[Any, Any]:
    """:func:`_planned`, then cancelled."""
    ev, plan = await _planned(env, bundle, seed)
    await env["status"].cancel(ev.request_id)
    return ev, plan


async def test_cancelled_request_is_skipped_by_encode_and_prefill(
    env: dict[str, Any], bundle: ModelBundle
) -> None:
    cfg, store = env["cfg"], env["store"]
    ev, plan = await _cancelled_plan(env, bundle, seed=301)

    enc = EncodeWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    pre = PrefillWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    try:
        await enc.handle(plan.encode[0])
        await pre.handle(plan.prefill)
    finally:
        await enc.close()
        await pre.close()
    assert enc.skipped_cancelled == 1 and enc.encoder_calls == 0 and enc.items_encoded == 0
    assert not await store.exists(plan.encode[0].ec_transfer.key)  # nothing was encoded
    assert pre.tally.cancelled == 1 and pre.tally.completed == 0
    updates = {(e.stage, e.status) for e in await _results(cfg, ev.request_id)}
    assert updates == {("encode", "cancelled"), ("prefill", "cancelled")}


async def test_an_unsafe_encode_event_of_a_cancelled_request_is_still_refused(
    env: dict[str, Any], bundle: ModelBundle
) -> None:
    """Validation comes before the cancel check: a forged entry goes to the DLQ (the handler
    raises), not quietly into the 'skipped' count."""
    cfg, store = env["cfg"], env["store"]
    _, plan = await _cancelled_plan(env, bundle, seed=302)
    enc_ev = plan.encode[0]
    forged = dataclasses.replace(
        enc_ev, ec_transfer=dataclasses.replace(enc_ev.ec_transfer, key="ec:other-tenant:key")
    )
    enc = EncodeWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    try:
        with pytest.raises(ValidationError):
            await enc.handle(forged)
    finally:
        await enc.close()
    assert enc.skipped_cancelled == 0 and enc.encoder_calls == 0


async def test_a_cancel_ends_the_prefill_wait_for_embeddings_that_will_not_come(
    env: dict[str, Any], bundle: ModelBundle
) -> None:
    """The encoder skips a cancelled request's items, so its embeddings never arrive: the
    prefill worker waiting for them is woken by the cancel instead of its 60 s timeout."""
    cfg, store = env["cfg"], env["store"]
    ev, plan = await _planned(env, bundle, seed=303, prompt="Wait <image>")  # never encoded
    pre = PrefillWorker(
        WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]), embedding_wait_s=60
    )
    try:
        t0 = time.monotonic()
        waiting = asyncio.create_task(pre.handle(plan.prefill))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # waiting for the embedding
        await env["status"].cancel(ev.request_id)
        await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - t0 < 10
    finally:
        await pre.close()
    assert pre.tally.cancelled == 1 and pre.tally.completed == 0
    cancelled = [e for e in await _results(cfg, ev.request_id) if e.status == "cancelled"]
    assert [e.info.get("prefill.cancelled") for e in cancelled] == ["skipped before compute"]


async def test_same_request_runs_when_not_cancelled(
    env: dict[str, Any], bundle: ModelBundle
) -> None:
    # the control: without a cancel the same workers encode and complete
    cfg, store = env["cfg"], env["store"]
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        f"req-{uuid.uuid4().hex[:8]}",
        prompt="Run <image>",
        images=[synthetic_image(56, 56, seed=302)],
        sampling=SamplingParams(max_tokens=3),
    )
    plan = await FanOut(cfg, store, bundle.render_info()).plan(ev)
    enc = EncodeWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    pre = PrefillWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    try:
        await enc.handle(plan.encode[0])
        await pre.handle(plan.prefill)
    finally:
        await enc.close()
        await pre.close()
    assert enc.items_encoded == 1 and pre.tally.completed == 1 and pre.tally.cancelled == 0
    statuses = [e.status for e in await _results(cfg, ev.request_id)]
    assert statuses[-1] == "completed" and "decoding" in statuses


async def test_a_request_cancelled_mid_decode_keeps_the_tokens_it_made(
    env: dict[str, Any], bundle: ModelBundle
) -> None:
    """Issue 21 #14: the client's cancel makes the record ``cancelled`` at once (with no
    tokens); the worker stops between decode steps and its ``cancelled`` update carries the
    tokens it made, which the record keeps: exactly the start of the uncancelled generation."""
    cfg, store, status = env["cfg"], env["store"], env["status"]
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        f"req-{uuid.uuid4().hex[:8]}",
        prompt="Go on <image>",
        images=[synthetic_image(56, 56, seed=304)],
        sampling=SamplingParams(max_tokens=2000, ignore_eos=True),
    )
    plan = await FanOut(cfg, store, bundle.render_info()).plan(ev)
    enc = EncodeWorker(WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"]))
    pre = PrefillWorker(
        WorkerContext(cfg, bundle, store, env["producer"], cancel=env["watch"], record=status.apply)
    )
    assert await status.create(ev.request_id, {})  # as the intake does
    try:
        await enc.handle(plan.encode[0])
        running = asyncio.create_task(pre.handle(plan.prefill))
        for _ in range(200):
            rec = await status.get(ev.request_id)
            if rec is not None and rec.status == "decoding":
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # a few hundred steps in
        assert not running.done()
        await status.cancel(ev.request_id)
        await asyncio.wait_for(running, 30)
    finally:
        await enc.close()
        await pre.close()
    rec = await status.get(ev.request_id)
    assert rec is not None and rec.status == "cancelled"
    made = rec.token_ids
    assert made and 0 < len(made) < 2000, rec
    ids, pv, grid = monolithic_inputs(ev)
    assert made == generate_monolithic(bundle, ids, pv, grid, len(made), ignore_eos=True)
    assert rec.text == bundle.tokenizer.decode(made, skip_special_tokens=True)


def test_decode_loop_stops_between_steps(bundle: ModelBundle) -> None:
    state = prefill(bundle, [5, 6, 7, 8], [])
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) >= 4

    # Asked before the start and before each step: the fourth ask comes after three tokens.
    sampling = SamplingParams(max_tokens=50, ignore_eos=True)
    done, seq = decode_alone(bundle, lambda: state, sampling, should_stop=stop)
    assert done.outcome == CANCELLED
    assert len(seq.tokens) == 3  # three tokens made, stopped before the fourth step
    full = generate_from_embeddings(bundle, [5, 6, 7, 8], [], 3, ignore_eos=True)
    assert seq.tokens == full  # what was made is exactly the uncancelled prefix
