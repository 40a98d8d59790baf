"""``epd worker {encode,prefill,results,router}``: run one pipeline stage until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("epd.worker")

KINDS = ("encode", "prefill", "results", "router")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run a pipeline worker (encode, prefill, results, router)")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--model", help="'tiny' or a local checkpoint path (default: EPD_MODEL)")
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from runtime.settings import Settings

    overrides: dict[str, Any] = {}
    if args.model:
        overrides["model"] = args.model
    if args.store:
        overrides["store_url"] = args.store
    if args.device:
        overrides["device"] = args.device
    if args.max_in_flight:
        overrides["max_in_flight"] = args.max_in_flight
    settings = Settings(**overrides)
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
    kind: str, settings: Any, *, ready: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Build the stage's handler, join its consumer group and run until SIGTERM/SIGINT."""
    import redis.asyncio as aioredis

    from consumers.loop import ConsumeLoop, ConsumerConfig
    from consumers.reporting import dead_letter_reporter
    from runtime.kafka import ensure_topics, make_producer
    from runtime.stores import open_store
    from schemas.topics import GROUP_ENCODE, GROUP_PREFILL, GROUP_RESULTS, GROUP_ROUTER, Topics

    topics = Topics(settings.topic_prefix)
    if settings.ec_secret is None and kind in ("encode", "prefill", "router"):
        log.warning(
            "EPD_EC_SECRET is not set: ec_transfer_params are not signed, so any producer on "
            "the topics can name embedding keys of this model. Set it in production."
        )
    await ensure_topics(settings, topics.all())
    producer = make_producer(settings)
    await producer.start()
    closers: list[Callable[[], Awaitable[Any]]] = [producer.stop]
    worker_id = f"{kind}@{socket.gethostname()}:{os.getpid()}"
    try:
        handler: Callable[[Any], Awaitable[None]]
        if kind in ("encode", "prefill", "router"):
            store = open_store(settings.embedding_store_url)
            closers.append(store.close)
        cancel = None
        if kind in ("encode", "prefill"):
            # Cancels (DELETE /v1/requests/{id}) are checked before compute and between steps.
            from runtime.status_store import CancelWatch

            cancel_client = aioredis.Redis.from_url(settings.redis_url)
            cancel = CancelWatch(cancel_client, settings.topic_prefix)
            await cancel.start()
            closers.extend([cancel_client.aclose, cancel.close])
        if kind in ("encode", "prefill"):
            from runtime.model import load_model

            bundle = await asyncio.to_thread(load_model, settings.model, device=settings.device)
            log.info(
                "%s: model %s fingerprint %s on %s",
                worker_id,
                settings.model,
                bundle.fingerprint,
                bundle.device,
            )
        if kind == "encode":
            from gpu_workers.encode import EncodeWorker

            w = EncodeWorker(
                settings, bundle, store, producer, topics=topics, worker_id=worker_id, cancel=cancel
            )
            closers.append(w.close)
            handler, topic, group, stage, by_request = (
                w.handle,
                topics.encode,
                GROUP_ENCODE,
                "encode",
                False,
            )
        elif kind == "prefill":
            from gpu_workers.prefill import PrefillWorker

            pw = PrefillWorker(
                settings, bundle, store, producer, topics=topics, worker_id=worker_id, cancel=cancel
            )
            closers.append(pw.close)
            handler, topic, group, stage, by_request = (
                pw.handle,
                topics.prefill,
                GROUP_PREFILL,
                "prefill",
                True,
            )
        elif kind == "results":
            from consumers.results import ResultsCollector
            from runtime.status_store import StatusStore

            client = aioredis.Redis.from_url(settings.redis_url)
            closers.append(client.aclose)
            rc = ResultsCollector(
                StatusStore(client, prefix=settings.topic_prefix, ttl_s=settings.status_ttl_s)
            )
            handler, topic, group, stage, by_request = (
                rc.handle,
                topics.results,
                GROUP_RESULTS,
                "collector",
                True,
            )
        else:
            from producers.fanout import FanOut
            from producers.router import RenderRouter
            from runtime.model import load_render_info

            info = await asyncio.to_thread(load_render_info, settings.model)
            prefill_producer = make_producer(settings, compression=settings.prefill_compression)
            await prefill_producer.start()
            closers.append(prefill_producer.stop)
            router = RenderRouter(
                FanOut(
                    settings,
                    store,
                    info.fingerprint,
                    producer=producer,
                    prefill_producer=prefill_producer,
                    topics=topics,
                )
            )
            handler, topic, group, stage, by_request = (
                router.handle,
                topics.render,
                GROUP_ROUTER,
                "fanout",
                True,
            )

        async def on_event(ce: Any) -> None:
            await handler(ce.event)

        loop = ConsumeLoop(
            settings,
            ConsumerConfig(
                topics=[topic],
                group_id=group + settings.group_suffix,
                dlq_topic=topics.dlq,
                max_in_flight=settings.max_in_flight,
                max_attempts=settings.max_attempts,
            ),
            on_event,
            producer=producer,
            on_dead_letter=None
            if kind == "results"
            else dead_letter_reporter(producer, topics, stage, keyed_by_request=by_request),
        )
        log.info("%s: consuming %s as group %s", worker_id, topic, group)
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
        for close in reversed(closers):
            try:
                await close()
            except Exception:
                log.exception("%s: error while closing", worker_id)
