"""What the API's routes share, and the one place it is wired (the API's composition root)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiokafka.admin import AIOKafkaAdminClient

from frontend.api.admission import ApiAdmission, LagMonitor
from frontend.api.metrics import Metrics
from frontend.api.submit.media_urls import MediaFetcher
from frontend.api.submit.reading import BodyRules
from frontend.api.tenants import AdminTokens, Tenants
from media.image_decoder import ImageDecoder
from producers.chat import ChatTemplate
from producers.fanout import build_fanout
from producers.idempotency import IdempotencyStore
from producers.intake import Intake
from producers.render import Renderer
from runtime.fleet.snapshot import FleetProbe
from runtime.kafka import KafkaPublisher
from runtime.redis.client import redis_client
from runtime.redis.cluster import RedisClient
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from runtime.status import StatusNotifier, StatusStore
from runtime.token_stream import TokenStreams
from schemas.topics import Topics

if TYPE_CHECKING:
    from runtime.model import RenderInfo
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger("epd.api")


@dataclass
class ApiState:
    """Everything the routes share (one per process), built by :meth:`open`."""

    settings: Settings
    topics: Topics
    redis: RedisClient
    status: StatusStore
    notifier: StatusNotifier
    lag: LagMonitor
    tenants: Tenants
    store: EmbeddingStore
    info: RenderInfo
    limits: RequestLimits
    renderer: Renderer
    publisher: KafkaPublisher
    intake: Intake
    tokens: TokenStreams
    """Requests' token streams (the SSE ``token`` events and the OpenAI streams read them)."""
    chat: ChatTemplate
    """The model's chat template (the OpenAI-compatible routes)."""
    media: MediaFetcher
    """Fetches the http(s) media URLs ``EPD_API_IMAGE_URL_HOSTS`` allows."""
    bodies: BodyRules
    """How request bodies are read: size, deadline, and the process's byte budget."""
    fleet: FleetProbe
    """The fleet view: workers, lag, dead letters (``/readyz``, ``/metrics``, the admin route)."""
    admins: AdminTokens
    """Who may call the admin routes."""
    kafka_ready: asyncio.Event = field(default_factory=asyncio.Event)
    admin: AIOKafkaAdminClient | None = None
    """Started with the publisher: ``/readyz`` lists the topics through it."""
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    started_s: float = field(default_factory=time.time)
    chores: set[asyncio.Task[Any]] = field(default_factory=set)
    """Small tasks that outlive the HTTP request that began them (see :meth:`later`)."""

    def later(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        """Run ``work`` in the background, kept until it ends (e.g. cancelling a request whose
        client went away: the handler that noticed is itself being cancelled)."""
        task = asyncio.create_task(work, name=name)
        self.chores.add(task)
        task.add_done_callback(self.chores.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    @classmethod
    async def open(cls, settings: Settings, metrics: Metrics) -> ApiState:
        """Connect the API's pieces for ``settings``: Redis (status records, idempotency,
        admission), the embedding store, the Kafka publisher, the renderer and the intake.

        Refuses (``InsecureSettings``) to run without a real ``EPD_EC_SECRET``, as the workers
        do: the fan-out signs every embedding entry with it, and tenant salts derive from it."""
        from runtime.model import load_render_info
        from runtime.stores import open_store

        settings.require_signing("api")
        tenants = Tenants(settings.api_tenants(), secret=settings.secret_bytes())

        topics = Topics(settings.topic_prefix)
        # A bounded pool that waits: a burst of submits queues for connections, never fails.
        client = redis_client(settings, socket_connect_timeout=2.0, socket_timeout=10.0)
        status = StatusStore.for_settings(client, settings)
        info = await asyncio.to_thread(load_render_info, settings.model)
        store = open_store(settings.embedding_store_url)
        publisher = KafkaPublisher.for_pipeline(settings, topics)
        lag = LagMonitor(settings, topics)
        ready = asyncio.Event()
        limits = RequestLimits.from_settings(
            settings, vocab_size=info.vocab_size, model_context=info.context_length
        )
        intake = Intake(
            build_fanout(settings, store, info, publisher, record=status.apply),
            status,
            limits=limits,
            idempotency=_idempotency(client, settings, limits),
            admission=ApiAdmission(settings, status, lag, ready),
            salts=tenants.salt,
            render_concurrency=settings.api_render_concurrency,
            observer=metrics,
            span="api",
            retry_after_s=settings.api_retry_after_s,
        )
        return cls(
            settings=settings,
            topics=topics,
            redis=client,
            status=status,
            notifier=StatusNotifier(status),
            lag=lag,
            tenants=tenants,
            store=store,
            info=info,
            limits=limits,
            renderer=_renderer(info, settings),
            publisher=publisher,
            intake=intake,
            tokens=TokenStreams.from_settings(client, settings),
            chat=ChatTemplate.for_model(info, settings.model, settings.chat_template),
            media=MediaFetcher.from_settings(settings),
            bodies=BodyRules.from_settings(settings),
            fleet=FleetProbe(settings, topics, status),
            admins=AdminTokens(settings.admin_names(), api_open=tenants.open),
            kafka_ready=ready,
        )

    async def start(self) -> None:
        """Status notifications, the lag sampler, and the broker connection (in the
        background: Kafka may come up after the API; until then submissions answer 503 and
        ``/readyz`` says why)."""
        await self.notifier.start()
        await self.lag.start()
        if self.renderer.decoder is not None:
            await self.renderer.decoder.start()
        self._tasks.append(asyncio.create_task(self._connect_kafka(), name="kafka-connect"))

    async def close(self) -> None:
        """Stop everything :meth:`start` began, after the enqueues still running finish."""
        for task in self._tasks:
            task.cancel()
        pending = [*self._tasks, *self.intake.tasks]
        if pending:
            # Together, not one timeout each: a stuck enqueue costs the shutdown 10 s once.
            await asyncio.wait(pending, timeout=10)
        for task in list(self.chores):
            task.cancel()
        await self.lag.close()
        await self.fleet.close()
        await self.notifier.close()
        await self.tokens.close()
        with contextlib.suppress(Exception):
            await self.publisher.stop()
        if self.admin is not None:
            with contextlib.suppress(Exception):
                await self.admin.close()
        await self.store.close()
        if self.renderer.decoder is not None:
            await self.renderer.decoder.close()
        await self.redis.aclose()

    async def _connect_kafka(self) -> None:
        """Start the producers, retrying with backoff until the broker answers."""
        delay = 0.5
        while True:
            try:
                await self.publisher.start()
                admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
                await admin.start()
                self.admin = admin
                self.kafka_ready.set()
                log.info("connected to Kafka at %s", self.settings.kafka_bootstrap)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("Kafka not reachable yet (%s); retrying in %.1fs", exc, delay)
                with contextlib.suppress(Exception):
                    await self.publisher.stop()
                self.publisher = KafkaPublisher.for_pipeline(self.settings, self.topics)
                self.intake.fanout.publisher = self.publisher
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)


def _renderer(info: RenderInfo, settings: Settings) -> Renderer:
    """The API's renderer: client images decode in processes a timeout kills, one per render
    slot."""
    renderer = Renderer.for_settings(info, settings, max_video_bytes=settings.api_max_video_bytes)
    renderer.decoder = ImageDecoder(renderer.image_limits, settings.api_render_concurrency)
    return renderer


def _idempotency(
    client: RedisClient, settings: Settings, limits: RequestLimits
) -> IdempotencyStore:
    """The Idempotency-Key claims, keys held to the id limit."""
    return IdempotencyStore(
        client,
        settings.topic_prefix,
        settings.api_idempotency_ttl_s,
        max_key_chars=limits.max_id_chars,
    )
