"""``epd worker {encode,prefill,results,router}``: run one pipeline stage until SIGTERM.

Each stage is one row of :data:`STAGES`: the topics it reads, its consumer group, how its
dead letters are reported, and a builder that assembles its handler from shared parts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.families import MODEL_HELP
from schemas.topics import Topics

if TYPE_CHECKING:
    from runtime.kafka import KafkaPublisher
    from runtime.settings import Settings
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger("epd.worker")

Handler = Callable[[Any], Awaitable[None]]
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
        from runtime.redis_client import redis_client
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
        from runtime.redis_client import redis_client
        from runtime.status import StatusStore

        if self._status is None:
            client = redis_client(self.settings)
            self.closers.append(client.aclose)
            self._status = StatusStore(
                client, prefix=self.settings.topic_prefix, ttl_s=self.settings.status_ttl_s
            )
        return self._status

    async def load_model(self) -> Any:
        """The model on the configured device (in a thread: loading takes seconds)."""
        from runtime.model import load_model

        bundle = await asyncio.to_thread(
            load_model, self.settings.model, device=self.settings.device
        )
        log.info(
            "%s: model %s fingerprint %s on %s",
            self.worker_id,
            self.settings.model,
            bundle.fingerprint,
            bundle.device,
        )
        return bundle


async def _build_gpu_worker(ctx: StageContext, kind: str, **extra: Any) -> Handler:
    """An encode or prefill worker: the model, the store, the publisher and a cancel watch."""
    from gpu_workers.encode import EncodeWorker
    from gpu_workers.prefill import PrefillWorker

    worker_cls = EncodeWorker if kind == "encode" else PrefillWorker
    store = ctx.open_store()
    w = worker_cls(
        ctx.settings,
        await ctx.load_model(),
        store,
        ctx.publisher,
        topics=ctx.topics,
        worker_id=ctx.worker_id,
        cancel=await ctx.cancel_watch(),
        **extra,
    )
    ctx.closers.append(w.close)
    return w.handle


async def _build_encode(ctx: StageContext) -> Handler:
    from prometheus_client import REGISTRY

    # Encoder-cache hit ratio and bytes in/out, on the same /metrics as the consume loop's.
    # Each item's encoded mark goes straight into its request's status record too, so the
    # request's outcome (written through by prefill) never arrives before its encode timings.
    return await _build_gpu_worker(
        ctx, "encode", registry=REGISTRY, record=ctx.status_store().apply
    )


async def _build_prefill(ctx: StageContext) -> Handler:
    from runtime.status import RequestReader

    # Prefill reads the request's status record: replays of a finished request are skipped,
    # and a lost embedding ends the request at once (embedding-lost) instead of a long wait.
    # It also writes its updates through to the record, so the client does not wait for the
    # results collector's hop to see the outcome.
    status = ctx.status_store()
    return await _build_gpu_worker(
        ctx, "prefill", request_state=RequestReader(status), record=status.apply
    )


async def _build_results(ctx: StageContext) -> Handler:
    from consumers.results import ResultsCollector

    status = ctx.status_store()
    if ctx.settings.sweep_interval_s > 0:
        await _start_sweep(ctx, status)
    return ResultsCollector(status).handle


async def _start_sweep(ctx: StageContext, status: Any) -> None:
    """The sweep of requests nobody will finish (:mod:`consumers.sweeper`), beside the loop."""
    from consumers.sweeper import BrokerProgress, Sweeper
    from runtime.kafka import KafkaPublisher, ResultReporter

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


async def _build_router(ctx: StageContext) -> Handler:
    from producers.fanout import build_fanout
    from producers.router import RenderRouter
    from runtime.model import load_render_info

    store = ctx.open_store()
    info = await asyncio.to_thread(load_render_info, ctx.settings.model)
    fanout = build_fanout(ctx.settings, store, info, ctx.publisher, record=ctx.status_store().apply)
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
    help: str
    topics: Callable[[Topics], list[str]]
    group: str
    """The stage name in its consumer group id (``Topics.group``: ``{prefix}-{stage}``)."""
    build: Callable[[StageContext], Awaitable[Handler]]
    report_as: str | None
    """Stage name on the ``rejected``/``failed`` status of a dead-lettered request; None: none."""
    keyed_by_request: bool
    """Whether the record key is the request id (for reporting undecodable records)."""
    uses_model: bool = True
    """Whether the stage loads the model (or its render info): checked at start-up."""
    fetch_wait_ms: Callable[[Settings], int | None] = lambda _: None
    """The stage's own fetch wait, if it has one (None: ``EPD_KAFKA_FETCH_MAX_WAIT_MS``)."""
    fetch_min_bytes: Callable[[Settings], int | None] = lambda _: None
    """Bytes the broker gathers before answering this stage's fetch (None: one record)."""


STAGES: dict[str, Stage] = {
    s.kind: s
    for s in (
        Stage(
            "encode",
            "vision tower on encoder inputs, embeddings into the store",
            lambda t: [t.encode],
            "encode",
            _build_encode,
            report_as="encode",
            keyed_by_request=False,
        ),
        Stage(
            "prefill",
            "wait for embeddings, splice, prefill and decode",
            lambda t: [t.prefill],
            "prefill",
            _build_prefill,
            report_as="prefill",
            keyed_by_request=True,
        ),
        Stage(
            "results",
            "fold stage updates and per-item encode records into status records",
            lambda t: [t.results, t.encoded],
            "results",
            _build_results,
            report_as=None,
            keyed_by_request=True,
            uses_model=False,
            fetch_wait_ms=lambda s: s.results_fetch_max_wait_ms,
            fetch_min_bytes=lambda s: s.results_fetch_min_bytes,
        ),
        Stage(
            "router",
            "fan RenderEvents from external renderers out to encode and prefill",
            lambda t: [t.render],
            "router",
            _build_router,
            report_as="fanout",
            keyed_by_request=True,
        ),
    )
}
KINDS = tuple(STAGES)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="run a pipeline worker (" + ", ".join(KINDS) + ")",
        description="Run one pipeline stage until SIGTERM/SIGINT (then drain and commit). "
        + " ".join(f"{s.kind}: {s.help}." for s in STAGES.values()),
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--model", help=f"{MODEL_HELP} (default: EPD_MODEL)")
    p.add_argument("--store", help="embedding store URI (default: EPD_STORE_URL or EPD_REDIS_URL)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (default: EPD_DEVICE)")
    p.add_argument(
        "--max-in-flight", type=int, help="concurrent events (default: EPD_MAX_IN_FLIGHT)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port"
    )
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--ready-file",
        type=Path,
        default=os.environ.get("EPD_READY_FILE") or None,
        help="touch this file once the worker holds partitions (for supervisors and the demo)",
    )
    p.add_argument(
        "--print-settings",
        action="store_true",
        help="print the settings this worker would run with as JSON (secrets as a SHA-256 "
        "digest) and exit",
    )
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``EPD_*`` settings with this command's flags on top."""
    from runtime.settings import Settings

    flags = {
        "model": args.model,
        "store_url": args.store,
        "device": args.device,
        "max_in_flight": args.max_in_flight,
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.print_settings:
        json.dump({"kind": args.kind, "settings": settings.describe()}, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    if STAGES[args.kind].uses_model:
        from runtime.model import model_family

        # Refuse an unsupported model family before joining any group (ModelLoadError: exit 2).
        model_family(settings.model)
    from runtime.logs import configure_logging

    configure_logging(args.log_level, settings.log_format)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr="127.0.0.1")
    ready = None
    if args.ready_file is not None:
        ready_file: Path = args.ready_file
        ready_file.unlink(missing_ok=True)

        async def ready() -> None:
            await asyncio.to_thread(ready_file.write_text, f"{os.getpid()}\n")

    asyncio.run(run_worker(args.kind, settings, ready=ready))
    return 0


async def _when_assigned(loop: Any, ready: Callable[[], Awaitable[None]]) -> None:
    await loop.assigned.wait()  # partitions arrive with the first poll after the group join
    await ready()


async def run_worker(
    kind: str, settings: Settings, *, ready: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Build the stage's handler, join its consumer group and run until SIGTERM/SIGINT."""
    from prometheus_client import REGISTRY

    from consumers.loop import ConsumeLoop, ConsumerConfig
    from consumers.reporting import dead_letter_reporter
    from runtime.kafka import KafkaPublisher, ensure_topics, transactional_id
    from schemas.codec import get_codec

    stage = STAGES[kind]
    topics = Topics(settings.topic_prefix)
    settings.require_signing(kind)  # no real EPD_EC_SECRET: refuse, unless EPD_ALLOW_UNSIGNED
    # The codec's schemas and converters are built now, not by the first event's decode.
    await asyncio.to_thread(get_codec)
    await ensure_topics(settings, topics.all())
    # Transactional: the handlers publish with the loop's transactional producer, so their
    # outputs commit (or abort) together with the batch's offsets.
    txn_id = (
        transactional_id(settings, topics.group(stage.group))
        if settings.kafka_transactions
        else None
    )
    publisher = KafkaPublisher.for_pipeline(settings, topics, txn_id=txn_id)
    await publisher.start()
    ctx = StageContext(settings, topics, publisher, f"{kind}@{socket.gethostname()}:{os.getpid()}")
    ctx.closers.append(publisher.stop)
    try:
        handler = await stage.build(ctx)

        async def on_event(ce: Any) -> None:
            await handler(ce.event)

        reporter = None
        if stage.report_as is not None:
            reporter = dead_letter_reporter(
                publisher,
                topics,
                stage.report_as,
                keyed_by_request=stage.keyed_by_request,
                record=ctx.status_store().apply,
            )
        await ctx.warm()
        loop = ConsumeLoop(
            settings,
            ConsumerConfig(
                topics=stage.topics(topics),
                group_id=topics.group(stage.group),
                dlq_topic=topics.dlq,
                max_in_flight=settings.max_in_flight,
                max_attempts=settings.max_attempts,
                transient_retry_s=settings.transient_retry_s,
                consumer_overrides=_fetch_overrides(stage, settings),
            ),
            on_event,
            producer=publisher.producer,
            on_dead_letter=reporter,
            registry=REGISTRY,  # served by --metrics-port
        )
        log.info(
            "%s: consuming %s as group %s",
            ctx.worker_id,
            stage.topics(topics),
            topics.group(stage.group),
        )
        await loop.start()
        announce = None
        if ready is not None:
            announce = asyncio.create_task(_when_assigned(loop, ready))
        try:
            await loop.run_until_signal()
        finally:
            if announce is not None:
                announce.cancel()
    finally:
        for close in reversed(ctx.closers):
            try:
                await close()
            except Exception:
                log.exception("%s: error while closing", ctx.worker_id)
