"""A prefill event written straight to the prefill topic is held to exactly what the door holds.

One real prefill worker (``epd worker prefill``'s own ``run_worker``, the tiny model on CPU, the
test broker and Redis) and one in-process API (``create_app``, the same settings) serve every
case. Each case is one bound the door refuses: the API's answer to ``POST /v1/requests`` is
compared with the dead letter the worker writes for the same values sent as a
``PrefillEvent`` that no door saw: the same rule, message, field and item.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from consumers.dead_letters.reader import read_dead_letters
from epd.stages import run_worker
from frontend.api import create_app
from runtime.kafka import KafkaPublisher, ensure_topics, make_producer, read_topic
from runtime.model import load_render_info
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from schemas.codec import decode
from schemas.topics import Topics
from schemas.types import TERMINAL_STATUSES, Features, PrefillEvent, ResultEvent, SamplingParams

pytestmark = pytest.mark.integration

CONTEXT = 64
"""``EPD_MAX_CONTEXT_TOKENS`` of this deployment (door and worker): a short context to pass."""
GUARD_S = 120.0
"""Against a hang only (a worker that never answers must fail the test, not stall the run)."""
VOCAB = load_render_info("tiny").vocab_size


@dataclass(frozen=True)
class Case:
    """One request, as the door's body and as the worker's event."""

    token_ids: list[int]
    max_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0

    def body(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }

    def event(self, request_id: str, model: str) -> PrefillEvent:
        sampling = SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p
        )
        return PrefillEvent(request_id, model, self.token_ids, Features({}, {}), sampling=sampling)


CASES = {
    # The worker capped temperature at nothing (the door at 2): it ran this one.
    "temperature 5": Case([1, 2, 3], temperature=5.0),
    # The worker refused these as rule "sampling", the door as "sampling.top_p".
    "top_p 1.5": Case([1, 2, 3], temperature=1.0, top_p=1.5),
    "top_p 0": Case([1, 2, 3], temperature=1.0, top_p=0.0),
    # The worker said "token-ids", the door (the renderer) "render.token_ids", in other words.
    "token id = vocabulary": Case([1, VOCAB, 2]),
    "token id far past the vocabulary": Case([1, 2, VOCAB + 1000]),
    # Prompt + max_tokens past the context; and a prompt that fills it, which the door words
    # as "no room" and the worker worded as the sum.
    "prompt + max_tokens past the context": Case(list(range(1, CONTEXT - 3)), max_tokens=8),
    "prompt fills the context": Case([5] * CONTEXT, max_tokens=1),
}


@dataclass
class Deployment:
    settings: Settings
    topics: Topics
    api: httpx.AsyncClient
    publisher: KafkaPublisher
    limits: RequestLimits
    """The API's own (the worker builds its own from the same settings)."""


async def _until(pred: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + GUARD_S
    while not await pred():
        if loop.time() > end:
            pytest.fail(f"gave up waiting for: {what}")
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
async def deployment(settings: Settings) -> AsyncIterator[Deployment]:
    """One prefill worker and one API on a fresh topic prefix, sharing their settings."""
    cfg = settings.model_copy(
        update={
            "topic_prefix": f"test-limits-{uuid.uuid4().hex[:10]}",
            "ec_secret": SecretStr(secrets.token_hex(16)),
            "api_tokens": None,
            "max_context_tokens": CONTEXT,
            "device": "cpu",
            "validation_mode": "strict",
        }
    )
    topics = Topics(cfg.topic_prefix)
    await ensure_topics(cfg, topics.all())
    assigned = asyncio.Event()

    async def ready() -> None:
        assigned.set()

    worker = asyncio.create_task(run_worker("prefill", cfg, ready=ready))
    producer = make_producer(cfg)
    await producer.start()
    app = create_app(cfg)
    try:
        await asyncio.wait_for(assigned.wait(), GUARD_S)
        async with app.router.lifespan_context(app):
            state = app.state.api
            await asyncio.wait_for(state.kafka_ready.wait(), GUARD_S)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
                yield Deployment(cfg, topics, api, KafkaPublisher(producer), state.limits)
    finally:
        await producer.stop()
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker


async def _door(d: Deployment, case: Case) -> dict[str, Any]:
    r = await d.api.post("/v1/requests", json=case.body())
    assert r.status_code in (413, 422), (r.status_code, r.text[:500])
    err = r.json()["error"]
    return {k: err.get(k) for k in ("rule", "message", "field", "item")}


async def _worker(d: Deployment, case: Case) -> dict[str, Any]:
    rid = f"straight-{uuid.uuid4().hex[:10]}"
    await d.publisher.send(d.topics.prefill, rid, case.event(rid, d.settings.model))
    outcome: list[ResultEvent] = []

    async def answered() -> bool:
        records = await read_topic(d.settings, d.topics.results, timeout_s=GUARD_S)
        events: list[Any] = [decode(r.value) for r in records]
        outcome[:] = [
            ev
            for ev in events
            if isinstance(ev, ResultEvent)
            and ev.request_id == rid
            and ev.status in TERMINAL_STATUSES
        ]
        return bool(outcome)

    await _until(answered, f"the prefill worker's outcome for {rid}")
    # A worker that runs the request (completes it) has refused nothing: no dead letter.
    assert outcome[0].status == "rejected", outcome[0]
    letters = [
        r.letter
        for r in await read_dead_letters(d.settings, d.topics.dlq, timeout_s=GUARD_S)
        if r.letter is not None and r.letter.key == rid.encode()
    ]
    assert len(letters) == 1, letters
    err = letters[0].error
    return {"rule": err.rule, "message": err.message, "field": err.field, "item": err.item}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_a_record_written_straight_to_the_topic_is_refused_as_the_door_refuses_it(
    deployment: Deployment, case: Case
) -> None:
    door = await _door(deployment, case)
    worker = await _worker(deployment, case)
    assert worker == door


def _vllm_body() -> dict[str, Any]:
    """A vLLM render response of one image, rendered by this pipeline's renderer."""
    from media.sample_images import synthetic_image
    from producers.render import Renderer
    from schemas.vllm_wire import GenerateRequest, generate_request_to_json

    ev = Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096).render(
        "vllm", prompt="From vLLM <image>", images=[synthetic_image(56, 56, seed=3)]
    )
    req = GenerateRequest(
        token_ids=ev.token_ids,
        features=ev.features,
        sampling_params={"max_tokens": 2, "temperature": 0.5, "top_p": 0.9},
        request_id=f"vllm-{uuid.uuid4().hex[:8]}",
    )
    return generate_request_to_json(req)


FRONTS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "native": (
        "/v1/requests",
        lambda: {"prompt": "hi", "max_tokens": 1, "temperature": 0.5, "top_p": 0.9},
    ),
    "openai": (
        "/v1/chat/completions",
        lambda: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_p": 0.9},
    ),
    "vllm": ("/v1/vllm/generate", _vllm_body),
}


@pytest.mark.parametrize("front", FRONTS.values(), ids=FRONTS.keys())
async def test_each_bound_is_checked_once_per_front(
    deployment: Deployment,
    monkeypatch: pytest.MonkeyPatch,
    front: tuple[str, Callable[[], dict[str, Any]]],
) -> None:
    """The sampling parameters and the item counts of one accepted request: checked by its
    route in the raw body, not a second time by the intake (they were twice)."""
    calls: Counter[str] = Counter()

    def spy(name: str) -> None:
        original = getattr(RequestLimits, name)

        def counted(self: RequestLimits, *args: Any, **kwargs: Any) -> Any:
            if self is deployment.limits:  # the API's, not the worker's
                calls[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(RequestLimits, name, counted)

    for name in ("check_sampling", "check_counts"):
        spy(name)
    path, body = front
    r = await deployment.api.post(path, json=body())
    assert r.status_code in (200, 202), r.text[:500]
    assert calls == {"check_sampling": 1, "check_counts": 1}
