"""Every stage's real handler subscribed to its topics on one in-memory broker (what the unit
tests that run a whole request in one process share)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from pydantic import SecretStr

from epd.stages import STAGES, StageContext
from runtime.memory_broker import InMemoryBroker
from runtime.settings import Settings
from schemas.topics import Topics

Stages = tuple[InMemoryBroker, StageContext, Topics]


@contextlib.asynccontextmanager
async def memory_stages(
    settings: Settings, redis_prefix: str, *, model: str, decode_stage: bool = False
) -> AsyncIterator[Stages]:
    """The router, encode, prefill and results stages (and decode, with ``decode_stage``) of
    ``model`` on an in-memory broker, a ``local://`` store and the test Redis's records."""
    cfg = settings.model_copy(
        update={
            "topic_prefix": redis_prefix.rstrip(":"),
            "store_url": f"local://{uuid.uuid4().hex}",
            "ec_secret": SecretStr(uuid.uuid4().hex),
            "model": model,
            "device": "cpu",
            "sweep_interval_s": 0.0,
            "decode_stage": decode_stage,
        }
    )
    topics = Topics(cfg.topic_prefix)
    broker = InMemoryBroker()
    ctx = StageContext(cfg, topics, broker, "memory")  # type: ignore[arg-type]
    kinds = ["router", "encode", "prefill", "results"] + (["decode"] if decode_stage else [])
    try:
        for kind in kinds:
            handler = await STAGES[kind].build(ctx)
            for topic in topics.read_by(kind):
                broker.subscribe(topic, handler)
        await ctx.warm()
        yield broker, ctx, topics
    finally:
        for close in reversed(ctx.closers):
            await close()
