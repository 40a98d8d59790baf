"""The intake every front submits through, against a real Redis (status records, admission):
a request is either fully enqueued or leaves nothing live behind, whatever fails and when."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from media.sample_images import synthetic_image
from producers.fanout import FanOut
from producers.intake import Intake, RenderContext, Submission
from producers.render import Renderer
from runtime.model import RenderInfo, load_render_info
from runtime.publisher import InMemoryPublisher
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from runtime.status import StatusStore
from runtime.stores.local import LocalStore
from schemas.errors import ValidationError
from schemas.topics import Topics
from schemas.types import Event, RenderEvent, SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def info() -> RenderInfo:
    return load_render_info("tiny")


class RecordingStore(LocalStore):
    """A local store that remembers every key it was asked to put."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.puts: list[str] = []

    async def put(self, key: str, tensor: Any, ttl_s: float | None = None) -> None:
        self.puts.append(key)
        await super().put(key, tensor, ttl_s)


class FailingPublisher(InMemoryPublisher):
    """Sends to the encode topic, then fails on the prefill one (a broker gone mid-request)."""

    def __init__(self, fail_on: str) -> None:
        super().__init__()
        self.fail_on = fail_on

    async def send(
        self,
        topic: str,
        key: str | None,
        event: Event,
        *,
        headers: Sequence[Any] = (),
        value: bytes | None = None,
    ) -> int:
        if topic.endswith(self.fail_on):
            raise ConnectionError("broker went away")
        return await super().send(topic, key, event, headers=headers, value=value)


@pytest.fixture
async def parts(
    settings: Settings, info: RenderInfo, redis_prefix: str
) -> AsyncIterator[dict[str, Any]]:
    cfg = settings.model_copy(
        update={
            "topic_prefix": redis_prefix.rstrip(":").replace(":", "-"),
            "allow_unsigned": True,
            "inline_limit_bytes": 16 * 1024,  # a 112x112 image is claim-checked
        }
    )
    client = aioredis.Redis.from_url(cfg.redis_url)
    status = StatusStore(client, prefix=cfg.topic_prefix, ttl_s=60)
    store = RecordingStore(f"local://intake-{uuid.uuid4().hex[:12]}")
    try:
        yield {"cfg": cfg, "status": status, "store": store, "client": client}
    finally:
        keys = [k async for k in client.scan_iter(match=f"{cfg.topic_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await store.close()


def intake(parts: dict[str, Any], info: RenderInfo, publisher: InMemoryPublisher) -> Intake:
    cfg, status = parts["cfg"], parts["status"]
    fanout = FanOut(
        cfg,
        parts["store"],
        info,
        publisher=publisher,
        topics=Topics(cfg.topic_prefix),
        record=status.apply,
    )
    limits = RequestLimits.from_settings(
        cfg, vocab_size=info.vocab_size, model_context=info.context_length
    )
    return Intake(fanout, status, limits=limits)


def submission(info: RenderInfo, seed: int, **kw: Any) -> Submission:
    renderer = Renderer(info, max_image_pixels=4096 * 4096)

    async def render(ctx: RenderContext) -> RenderEvent:
        return await renderer.render_async(
            ctx.request_id,
            prompt="<image>",
            images=[synthetic_image(56, 56, seed=seed)],
            sampling=ctx.sampling,
            cache_salt=ctx.cache_salt,
        )

    return Submission(render=render, **kw)


async def test_a_failure_once_events_may_be_out_records_failed(
    parts: dict[str, Any], info: RenderInfo
) -> None:
    pub = FailingPublisher(fail_on=".prefill")
    with pytest.raises(Exception) as exc:
        await intake(parts, info, pub).submit(submission(info, 1, request_id="half"))
    assert "broker went away" in str(exc.value) or exc.value.__class__.__name__ == "Refused"
    rec = await parts["status"].get("half")
    assert rec is not None and rec.status == "failed", rec  # terminal: not live
    assert rec.error is not None and rec.error["code"] == "enqueue_failed"


async def test_a_refusal_before_the_fan_out_leaves_no_record_and_sends_nothing(
    parts: dict[str, Any], info: RenderInfo
) -> None:
    pub = InMemoryPublisher()
    take = intake(parts, info, pub)
    with pytest.raises(ValidationError) as exc:
        await take.submit(
            submission(info, 2, request_id="long", sampling=SamplingParams(max_tokens=10**6))
        )
    assert exc.value.rule == "max-tokens"
    too_long = submission(info, 3, request_id="ctx")
    renderer = Renderer(info, max_image_pixels=4096 * 4096)

    async def long_prompt(ctx: RenderContext) -> RenderEvent:
        return await renderer.render_async(ctx.request_id, prompt="z" * (info.context_length + 1))

    too_long.render = long_prompt
    with pytest.raises(ValidationError) as exc:
        await take.submit(too_long)
    assert exc.value.rule == "context-length"
    assert pub.records == []
    assert await parts["status"].get("long") is None and await parts["status"].get("ctx") is None


async def test_an_event_the_wire_cannot_carry_is_refused_before_anything_is_stored(
    parts: dict[str, Any], info: RenderInfo
) -> None:
    """No limits (a trusted in-process caller): the fan-out itself encodes every event before
    it stores or sends any, so a token id beyond int64 leaves nothing behind."""
    pub = InMemoryPublisher()
    take = intake(parts, info, pub)
    take.limits = None
    ev = Renderer(info, max_image_pixels=4096 * 4096).render(
        "huge-id", prompt="<image>", images=[synthetic_image(112, 112, seed=4)]
    )
    ev.token_ids.append(2**63)
    with pytest.raises(ValidationError) as exc:
        await take.submit(Submission.rendered(ev))
    assert exc.value.rule == "event-encoding"
    assert pub.records == [] and await parts["status"].get("huge-id") is None
    assert parts["store"].puts == []  # no claim check was parked either


async def test_the_in_process_submitter_uses_the_same_intake(
    parts: dict[str, Any], info: RenderInfo
) -> None:
    from producers.submitter import Submitter

    pub = InMemoryPublisher()
    sub = Submitter.for_pipeline(
        parts["cfg"], info, store=parts["store"], publisher=pub, status=parts["status"]
    )
    ev, stats = await sub.submit(prompt="<image>", images=[synthetic_image(56, 56, seed=5)])
    rec = await parts["status"].get(ev.request_id)
    assert rec is not None and rec.status == "encoding"
    assert [it["mm_hash"] for it in rec.items] == ev.features.mm_hashes["image"]
    assert rec.render["ms"] > 0 and stats.encode_events == 1
