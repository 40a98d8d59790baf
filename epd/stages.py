"""The pipeline's stages: one row each in :data:`STAGES`, and :func:`run_worker`, which runs one.

A row says what a stage does, how its handler is assembled from shared parts (a builder taking
a :class:`StageContext`), how its dead letters are reported, and its own fetch settings; the
topics it reads and its consumer group come from the channel table (``schemas.topics``).
``epd worker KIND`` only parses arguments and calls :func:`run_worker` (as arq's ``cli.py``
hands a settings object to its ``run_worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas.topics import Topics

if TYPE_CHECKING:
    from consumers.loop import ConsumeLoop
    from gpu_workers.context import WorkerContext
    from gpu_workers.decode import DecodeWorker
    from gpu_workers.encode import EncodeWorker
    from gpu_workers.prefill import PrefillWorker
    from runtime.kafka import KafkaPublisher
    from runtime.settings import Settings
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger("epd.worker")

Handler = Callable[..., Awaitable[None]]
"""Takes a decoded event (and, for a stage that skips recorded updates, ``recorded=``)."""
Closer = Callable[[], Awaitable[Any]]


@dataclass
class StageContext:
    """What every stage builder gets: settings, topics, the publisher, and a list of closers."""

    settings: Settings
    topics: Topics
    publisher: KafkaPublisher
    worker_id: str
    closers: list[Closer] = field(default_factory=list)
    _status: Any = None

    def open_store(self) -> EmbeddingStore:
        """The configured embedding store, closed when the worker stops."""
        from runtime.stores import open_store

        store = open_store(self.settings.embedding_store_url)
        self.closers.append(store.close)
        return store

    async def cancel_watch(self) -> Any:
        """Cancels (``DELETE /v1/requests/{id}``), checked before compute and between steps."""
        from runtime.redis.client import redis_client
        from runtime.status import CancelWatch

        client = redis_client(self.settings)
        watch = CancelWatch(client, self.settings.topic_prefix)
        await watch.start()
        self.closers.extend([client.aclose, watch.close])
        return watch

    async def warm(self) -> None:
        """Ready what the builders opened for a request's first use (the status script)."""
        if self._status is not None:
            await self._status.warm()

    def status_store(self) -> Any:
        """The requests' status records: one per worker (its Redis client is closed when the
        worker stops), so what one part of the worker wrote is what the next one starts from."""
        from runtime.redis.client import redis_client
        from runtime.status import StatusStore

        if self._status is None:
            client = redis_client(self.settings)
            self.closers.append(client.aclose)
            self._status = StatusStore.for_settings(client, self.settings)
        return self._status

    async def worker_context(self) -> WorkerContext:
        """What a GPU worker is built from: the model, the store, this stage's publisher,
        topics and name, a cancel watch, and the status record, which every update is written
        through to (so the client does not wait for the results collector's hop). An item's
        encoded mark is written once its embedding is stored; a prefill worker that ran the
        moment the embedding landed waits for the mark before its outcome
        (``EmbeddingWait.marks_landed``)."""
        from gpu_workers.context import WorkerContext

        status = self.status_store()
        store = self.open_store()
        return WorkerContext(
            self.settings,
            await self.load_model(),
            store,
            self.publisher,
            topics=self.topics,
            worker_id=self.worker_id,
            cancel=await self.cancel_watch(),
            record=status.apply,
            record_all=status.apply_all,
        )

    async def load_model(self) -> Any:
        """The model on the configured device (in a thread: loading takes seconds)."""
        from runtime.model import load_model

        # EPD_ENGINE=vllm: the vLLM instance holds the weights; the worker reads the processor,
        # tokenizer and ids only, and leaves the GPU to it.
        weights = self.settings.engine != "vllm"
        bundle = await asyncio.to_thread(
            load_model, self.settings.model, device=self.settings.device, weights=weights
        )
        import torch

        log.info(
            "%s: model %s fingerprint %s on %s, %d torch thread(s)",
            self.worker_id,
            self.settings.model,
            bundle.fingerprint,
            bundle.device,
            torch.get_num_threads(),
        )
        return bundle


def _serve(ctx: StageContext, worker: EncodeWorker | PrefillWorker | DecodeWorker) -> Handler:
    """A worker's handler, the worker closed when the process stops."""
    ctx.closers.append(worker.close)
    return worker.handle


async def _build_encode(ctx: StageContext) -> Handler:
    from prometheus_client import REGISTRY

    from gpu_workers.encode import EncodeWorker

    # Encoder-cache hit ratio and bytes in/out, on the same /metrics as the consume loop's.
    return _serve(ctx, EncodeWorker(await ctx.worker_context(), registry=REGISTRY))


async def _build_prefill(ctx: StageContext) -> Handler:
    from gpu_workers.prefill import PrefillWorker

    return await _build_request_worker(ctx, PrefillWorker)


async def _build_decode(ctx: StageContext) -> Handler:
    from gpu_workers.decode import DecodeWorker

    return await _build_request_worker(ctx, DecodeWorker)


async def _build_request_worker(
    ctx: StageContext, worker_cls: type[PrefillWorker] | type[DecodeWorker]
) -> Handler:
    """A prefill or decode worker: both read the request's status record (replays of a
    finished request are skipped, and a lost embedding ends the request at once,
    embedding-lost, instead of a long wait) and stream tokens while they decode."""
    from runtime.status import RequestReader
    from runtime.token_stream import TokenStreams

    status = ctx.status_store()
    streams = (
        TokenStreams.from_settings(status.client, ctx.settings)
        if ctx.settings.stream_tokens
        else None
    )
    worker = worker_cls(
        await ctx.worker_context(), request_state=RequestReader(status), streams=streams
    )
    return _serve(ctx, worker)


async def _build_results(ctx: StageContext) -> Handler:
    from consumers.results import ResultsCollector

    status = ctx.status_store()
    sweeper = await _start_sweep(ctx, status) if ctx.settings.sweep_interval_s > 0 else None
    return ResultsCollector(status, on_update=sweeper.poke if sweeper else None).handle


async def _start_sweep(ctx: StageContext, status: Any) -> Any:
    """The sweep of requests nobody will finish (:mod:`consumers.sweeper`), beside the loop."""
    from consumers.sweeper import BrokerProgress, Sweeper
    from runtime.kafka import KafkaPublisher
    from runtime.reporting import ResultReporter

    publisher = ctx.publisher
    if ctx.settings.kafka_transactions:
        # The loop's producer sends only inside its batches' transactions; the sweep's
        # outcomes are not part of any batch, so they go through a plain producer.
        publisher = KafkaPublisher.for_pipeline(
            ctx.settings.model_copy(update={"kafka_transactions": False}), ctx.topics
        )
        await publisher.start()
        ctx.closers.append(publisher.stop)
    progress = BrokerProgress(ctx.settings)
    reporter = ResultReporter(publisher, ctx.topics.results, "sweep", ctx.worker_id)
    sweeper = Sweeper(ctx.settings, status, reporter.send, progress)
    task = asyncio.create_task(sweeper.run(), name="sweep")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await progress.close()

    ctx.closers.append(stop)
    return sweeper


async def _build_router(ctx: StageContext) -> Handler:
    from producers.fanout import build_fanout
    from producers.router import RenderRouter
    from runtime.render_keys import render_keys_apart

    store = ctx.open_store()
    # The router runs no model and holds no torch (its tensors are wire tensors: see
    # Stage.wire_tensors): the fingerprint and processor digest its keys are hashed with come
    # from a child process that loads the model's render info and exits.
    info = await render_keys_apart(ctx.settings.model)
    # The router is an external renderer's request's entry point: its fan-out's update
    # (marked routed) makes the request's record, as the intake's create does for the API's,
    # whether written through here or folded by the results collector.
    fanout = build_fanout(
        ctx.settings, store, info, ctx.publisher, record=ctx.status_store().apply, routed=True
    )
    return RenderRouter(fanout).handle


def _fetch_overrides(stage: Stage, settings: Settings) -> dict[str, Any]:
    """The stage's own fetch settings over the consumer defaults (none for most stages)."""
    out: dict[str, Any] = {}
    wait_ms = stage.fetch_wait_ms(settings)
    if wait_ms is not None:
        out["fetch_max_wait_ms"] = wait_ms
    min_bytes = stage.fetch_min_bytes(settings)
    if min_bytes is not None:
        out["fetch_min_bytes"] = min_bytes
    return out


@dataclass(frozen=True)
class Stage:
    """One kind of worker."""

    kind: str
    """The stage's name: its consumer group is ``Topics.group(kind)`` and it reads the topics
    the channel table gives it (``Topics.read_by(kind)``)."""
    help: str
    build: Callable[[StageContext], Awaitable[Handler]]
    report_as: str | None
    """Stage name on the ``rejected``/``failed`` status of a dead-lettered request; None: none."""
    uses_model: bool = True
    """Whether the stage loads the model (or its render info): checked at start-up."""
    computes: bool = True
    """Whether the stage runs the model (encode, prefill, decode): its process's torch threads
    follow where the model computes (``runtime.torch_threads``)."""
    makes_records: bool = False
    """Whether the stage is a request's entry point, whose first status write makes the
    record (the router, for an external renderer's request); every other stage only updates
    the record it finds (``StatusStore.apply``), so a record that went is not made again."""
    fetch_wait_ms: Callable[[Settings], int | None] = lambda _: None
    """The stage's own fetch wait, if it has one (None: ``EPD_KAFKA_FETCH_MAX_WAIT_MS``)."""
    fetch_min_bytes: Callable[[Settings], int | None] = lambda _: None
    """Bytes the broker gathers before answering this stage's fetch (None: one record)."""
    wire_tensors: bool = False
    """The stage's events decode their tensors as ``schemas.wire_tensor.WireTensor`` (numpy
    views, no torch; ``schemas.codec.wire_codec``): for a stage that only checks, hashes and
    forwards them (the router), so that its process never imports torch."""
    skips_recorded: bool = False
    """The handler is told (``recorded=True``) of records whose stage wrote them through to
    the status record already (``runtime.reporting.RECORDED_HEADER``): decoded (validated) as
    any, not folded again; the results collector folds only what a stage could not write."""


STAGES: dict[str, Stage] = {
    s.kind: s
    for s in (
        Stage(
            "encode",
            "vision tower on encoder inputs, embeddings into the store",
            _build_encode,
            report_as="encode",
        ),
        Stage(
            "prefill",
            "wait for embeddings, splice, prefill and decode (or, with EPD_DECODE_STAGE, park "
            "the KV cache and hand the request to decode workers)",
            _build_prefill,
            report_as="prefill",
        ),
        Stage(
            "decode",
            "continue requests prefill workers handed over (EPD_DECODE_STAGE): read the parked "
            "KV cache, decode in a batch, stream",
            _build_decode,
            report_as="decode",
        ),
        Stage(
            "results",
            "fold stage updates and per-item encode records into status records",
            _build_results,
            report_as=None,
            uses_model=False,
            computes=False,
            fetch_wait_ms=lambda s: s.results_fetch_max_wait_ms,
            fetch_min_bytes=lambda s: s.results_fetch_min_bytes,
            skips_recorded=True,
        ),
        Stage(
            "router",
            "fan RenderEvents from external renderers out to encode and prefill",
            _build_router,
            report_as="fanout",
            computes=False,
            makes_records=True,
            wire_tensors=True,
        ),
    )
}
KINDS = tuple(STAGES)


class WorkerCannotStart(RuntimeError):
    """A worker could not start because the broker or a store could not be reached: the
    command says so in one line (``epd.cli``), not a traceback. Once started, a worker rides
    out outages instead (its loop retries)."""

    def __init__(self, kind: str, settings: Settings, exc: BaseException) -> None:
        from aiokafka.errors import KafkaError
        from redis.exceptions import RedisError

        if isinstance(exc, KafkaError):
            what = f"the broker at {settings.kafka_bootstrap} (EPD_KAFKA_BOOTSTRAP)"
        elif isinstance(exc, RedisError):
            what = "Redis (EPD_REDIS_URL)"
        else:
            what = "a store it needs (EPD_REDIS_URL, EPD_EMBEDDING_STORE_URL)"
        said = str(exc)
        if type(exc).__name__ not in said:
            said = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
        super().__init__(f"the {kind} worker cannot start: {what} did not answer ({said})")


@contextlib.asynccontextmanager
async def _starting(kind: str, settings: Settings) -> AsyncIterator[None]:
    """An unreachable service while the worker starts is :class:`WorkerCannotStart`."""
    from consumers.retry import default_is_infrastructure

    try:
        yield
    except Exception as exc:
        if default_is_infrastructure(exc):
            raise WorkerCannotStart(kind, settings, exc) from exc
        raise


async def run_worker(
    kind: str, settings: Settings, *, ready: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Build the stage's handler, join its consumer group and run until SIGTERM/SIGINT
    (``ready``: called once the worker holds partitions). A broker or store that does not
    answer while it starts is :class:`WorkerCannotStart`."""
    stage = STAGES[kind]
    async with _starting(kind, settings):
        ctx = await _open_context(kind, settings)
    try:
        async with _starting(kind, settings):
            loop = await _consume_loop(stage, ctx, await stage.build(ctx))
            log.info(
                "%s: consuming %s as group %s",
                ctx.worker_id,
                ctx.topics.read_by(kind),
                ctx.topics.group(kind),
            )
            ctx.closers.append(await _announce(stage, ctx, loop))
            await loop.start()
        await _run_until_signal(loop, ready)
    finally:
        for close in reversed(ctx.closers):
            try:
                await close()
            except Exception:
                log.exception("%s: error while closing", ctx.worker_id)


async def _announce(stage: Stage, ctx: StageContext, loop: ConsumeLoop) -> Closer:
    """The worker's announcements in the fleet (and its heartbeat file), until it stops."""
    import time

    from runtime.fleet.announcement import announcement_for
    from runtime.fleet.announcer import Announcer
    from runtime.fleet.board import FleetBoard

    status = ctx.status_store()
    settings = ctx.settings
    identity = announcement_for(settings, stage.kind, ctx.worker_id, int(time.time() * 1000))
    announcer = Announcer(
        FleetBoard(status.client, status.keys),
        identity,
        loop,
        interval_s=settings.fleet_announce_s,
        ttl_s=settings.fleet_ttl_s,
        heartbeat_file=settings.heartbeat_file,
    )
    announcer.start()
    return announcer.close


async def _open_context(kind: str, settings: Settings) -> StageContext:
    """Refuse what cannot run (no EC secret), make the topics, start the publisher."""
    from runtime.kafka import KafkaPublisher, ensure_topics, transactional_id
    from schemas.codec import get_codec

    topics = Topics(settings.topic_prefix)
    settings.require_signing(kind)  # no real EPD_EC_SECRET: refuse, unless EPD_ALLOW_UNSIGNED
    # The codec's schemas and converters are built now, not by the first event's decode.
    await asyncio.to_thread(get_codec)
    await ensure_topics(settings, topics.all())
    # Transactional: the handlers publish with the loop's transactional producer, so their
    # outputs commit (or abort) together with the batch's offsets.
    txn_id = transactional_id(settings, topics.group(kind)) if settings.kafka_transactions else None
    publisher = KafkaPublisher.for_pipeline(settings, topics, txn_id=txn_id)
    await publisher.start()
    ctx = StageContext(settings, topics, publisher, f"{kind}@{socket.gethostname()}:{os.getpid()}")
    ctx.closers.append(publisher.stop)
    return ctx


async def _consume_loop(stage: Stage, ctx: StageContext, handler: Handler) -> ConsumeLoop:
    """The stage's consume loop around ``handler``, with its dead letters reported."""
    from prometheus_client import REGISTRY

    from consumers.config import ConsumerConfig
    from consumers.loop import ConsumeLoop
    from consumers.reporting import dead_letter_reporter
    from runtime.reporting import was_recorded
    from schemas.codec import get_codec, wire_codec

    skip_recorded = stage.skips_recorded

    async def on_event(ce: Any) -> None:
        if skip_recorded:
            await handler(ce.event, recorded=was_recorded(ce.headers))
        else:
            await handler(ce.event)

    reporter = None
    if stage.report_as is not None:
        status = ctx.status_store()
        reporter = dead_letter_reporter(
            ctx.publisher,
            ctx.topics,
            stage.report_as,
            record=status.start if stage.makes_records else status.apply,
        )
    await ctx.warm()
    settings = ctx.settings
    return ConsumeLoop(
        settings,
        ConsumerConfig(
            topics=ctx.topics.read_by(stage.kind),
            group_id=ctx.topics.group(stage.kind),
            dlq_topic=ctx.topics.dlq,
            max_in_flight=settings.max_in_flight,
            max_attempts=settings.max_attempts,
            transient_retry_s=settings.transient_retry_s,
            consumer_overrides=_fetch_overrides(stage, settings),
        ),
        on_event,
        decode=(wire_codec() if stage.wire_tensors else get_codec()).decode,
        producer=ctx.publisher.producer,
        on_dead_letter=reporter,
        registry=REGISTRY,  # served by --metrics-port
        # A memory broker (Tansu) that restarts loses its logs; such brokers do no transactions.
        rewind_lost_logs=not settings.kafka_transactions,
        remake_topics=lambda: _remake_topics(ctx),
    )


async def _remake_topics(ctx: StageContext) -> None:
    """Make the pipeline's topics again (a broker that lost them: see ``consumers.lost_logs``)."""
    from runtime.kafka import ensure_topics

    made = await ensure_topics(ctx.settings, ctx.topics.all(), timeout_s=REMAKE_TOPICS_S)
    if made:
        log.warning("%s: made the lost topics again: %s", ctx.worker_id, ", ".join(made))


REMAKE_TOPICS_S = 5.0
"""How long the consume loop waits for the broker to make lost topics again (it reads no
records meanwhile; a failure is logged and the broker's auto-creation is the fallback)."""


async def _run_until_signal(loop: ConsumeLoop, ready: Callable[[], Awaitable[None]] | None) -> None:
    """Run the started ``loop`` until a signal (``ready`` once it holds partitions)."""
    announce = None
    if ready is not None:
        announce = asyncio.create_task(_when_assigned(loop, ready))
    try:
        await loop.run_until_signal()
    finally:
        if announce is not None:
            announce.cancel()


async def _when_assigned(loop: Any, ready: Callable[[], Awaitable[None]]) -> None:
    await loop.assigned.wait()  # partitions arrive with the first poll after the group join
    await ready()
