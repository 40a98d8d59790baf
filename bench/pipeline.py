"""The real pipeline on loopback: per-request overhead on both brokers, and prefill-path throughput.

Two docs/design.md budgets, measured in one run against real brokers and Redis (DB 11, every key
under one ``bench-...`` prefix, deleted afterwards):

1. **Overhead** (end-to-end minus model compute, p50 <= 5 ms, judged **on Apache Kafka**, for a
   new and for a cached image), measured on **both embedded brokers side by side**: Apache Kafka
   4.4 and Tansu, each started here on a fresh data directory (``epd.services``) and run with the
   fetch wait it suits, as ``epd up`` runs it (500 ms for Apache Kafka, which answers a waiting
   fetch when a record lands; 10 ms for Tansu, which answers only when the wait ends).
   ``EPD_BENCH_BROKERS=apache,tansu`` (the default) picks them; ``env`` runs on the broker of
   ``EPD_KAFKA_BOOTSTRAP`` instead. ``local_pipeline`` spawns the results, encode and prefill
   workers (tiny model, CPU). Single-image requests (224x224, a new image each, so the encoder
   really runs) are submitted one at a time: nothing queues behind anything. Per request,
   end-to-end runs from just before ``submit_rendered`` (the ``queued`` status write; rendering
   is done before, and reported apart) to the moment the client sees the terminal status
   record, read when the record's change notification wakes it (Redis pub/sub, as the API's
   long-poll and event stream wait; not ``Submitter.wait``'s 20-250 ms back-off, which would add
   up to 250 ms of detection delay, nor a 1 ms polling loop, which would load the cores the
   pipeline runs on). Model compute is (a) ``prefill_decode``, which the prefill worker times
   around its prefill and decode alone (the request's run in the decode engine), plus (b) the
   vision tower: the encode worker's
   ``encode.image0`` also covers the claim-check fetch, digest and value checks, the
   micro-batcher and the store put, so it is NOT subtracted; instead this process runs
   ``encode_images`` on the same pixels with the same tiny model right after each request
   (workers idle), and that time is. A second, smaller set repeats one image (an encoder-cache
   hit: no encode at all).
2. **Throughput vs shipping full kwargs_data to prefill** (higher, reported; on the first
   broker). The model compute is identical either way, so only the prefill event's transport
   differs: its Avro encode, the produce through the broker, the fetch and the decode. Our
   metadata-only PrefillEvents (from ``FanOut.plan`` of the same requests) and the same events
   with ``kwargs_data`` filled in (pixel values inline) are pushed through one-partition topics
   by one producer and read back by one consumer, concurrently; events/s = N / (last decode -
   first encode). The baseline is run with the pipeline's prefill compression and without
   compression; the ratio is judged against the faster of the two. That consumer uses a 5 ms
   fetch wait, so the rate is per-event cost, not the tail of an idle long-poll.

``kafka_hop`` takes one broker hop apart, per broker: a 100-byte record's produce and its ack
(``send_and_wait``), the time from the ack until the waiting fetch returns it (the broker's
answer, and aiokafka's parse of the response), the decode of a real PrefillEvent with our codec,
and the hand-off to a handler task (as the consume loop dispatches one), each record sent at a
random point of the consumer's fetch wait, as a request's records are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.common import Stats, budget, headroom, ratio, sig
from schemas.status_record import StatusRecord

MAX_OVERHEAD_P50_MS = 5.0
MIN_THROUGHPUT_RATIO = 1.0
REDIS_DB = 11
IMAGE_SIDE = 224
"""The tiny model's largest image: 256 patches, 64 image tokens, 1.2 MB of fp32 pixels."""
MAX_TOKENS = 4
WAKE_CHECK_S = 1.0
"""Longest a wait for a request sleeps without a notification before it checks the workers."""
FAST_FETCH_WAIT_MS = 5
REQUEST_TIMEOUT_S = 120.0
PROMPT = "Describe <image> briefly."


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """How many requests and events one run uses."""

    warmup: int
    misses: int
    hits: int
    events: int
    hops: int
    idle_s: float
    broker_warmup: int


QUICK = Sizes(warmup=2, misses=6, hits=3, events=40, hops=5, idle_s=1.0, broker_warmup=20)
FULL = Sizes(warmup=4, misses=40, hits=15, events=200, hops=20, idle_s=10.0, broker_warmup=300)


def _redis_db_url(redis_url: str) -> str:
    """``redis_url``'s server, DB 11 (the benchmarks' database), no query."""
    p = urlsplit(redis_url)
    auth = f":{p.password}@" if p.password else ""
    return f"redis://{auth}{p.hostname or '127.0.0.1'}:{p.port or 6379}/{REDIS_DB}"


async def render_request(run: Any, image: Any, salt: str) -> Any:
    """The benchmarks' request: ``PROMPT`` with one image, ``MAX_TOKENS`` new tokens, rendered
    by the run's own renderer (a new request id each time)."""
    from schemas.types import SamplingParams

    return await run.submitter.renderer.render_async(
        uuid.uuid4().hex,
        prompt=PROMPT,
        images=[image],
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        cache_salt=salt,
    )


def pipeline_settings(
    redis_url: str | None, broker_env: dict[str, str] | None = None
) -> tuple[Any, str]:
    """Settings for a benchmark pipeline (tiny model on CPU, Redis DB 11) and its unique prefix:
    topics, status records and embeddings all live under it and are deleted afterwards.
    ``broker_env``: ``EPD_*`` lines of a broker started here (they replace the environment's)."""
    from runtime.settings import Settings

    given: dict[str, Any] = {
        k.removeprefix("EPD_").lower(): v for k, v in (broker_env or {}).items()
    }
    given.pop("redis_url", None)  # the benchmark's Redis stays the environment's
    env = Settings().model_validate({**Settings().model_dump(), **given})
    db_url = _redis_db_url(redis_url or env.redis_url)
    prefix = f"bench-{uuid.uuid4().hex[:12]}"
    settings = env.model_copy(
        update={
            "redis_url": db_url,
            "store_url": f"{db_url}?key_prefix={prefix}:",
            # local_pipeline appends a run id: status keys land under the same prefix.
            "topic_prefix": prefix,
            "model": "tiny",
            "device": "cpu",
        }
    )
    return settings, prefix


def _ms_stats(samples: list[float]) -> dict[str, float | int]:
    """p50/p90/mean in ms. No min: parts stamped in whole ms can legitimately be 0 once."""
    s = Stats(samples)
    return {"p50_ms": sig(s.p50), "p90_ms": sig(s.p90), "mean_ms": sig(s.mean), "n": len(samples)}


# ---------------------------------------------------------------------------------------------
# 1. Overhead of single requests


async def _await_terminal(
    run: Any, request_id: str, changed: asyncio.Event
) -> tuple[StatusRecord, float]:
    """Read the record at each change notification; (record, wall-clock ms when first seen
    terminal). ``changed`` is the request's StatusNotifier event, armed before the submit."""

    status = run.submitter.status
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        changed.clear()  # before the read: a change after it sets the event again
        rec = await status.get(request_id)
        seen_ms = time.time() * 1000
        if rec is not None and rec.terminal:
            return rec, seen_ms
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), WAKE_CHECK_S)
        if not changed.is_set():  # a crashed worker ends the run with its log, not a timeout
            run.workers.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} not finished after {REQUEST_TIMEOUT_S}s")


async def _settled(run: Any, request_id: str, rec: StatusRecord) -> StatusRecord:
    """The record once the fan-out's and encoder's updates are folded in too.

    The results worker applies updates concurrently, so these can land just after the
    terminal status; they only feed the breakdown, never the end-to-end time.
    """
    deadline = time.monotonic() + 10.0

    def complete(r: StatusRecord) -> bool:
        if "fanout" not in r.timings:
            return False
        return r.encode_events == 0 or r.encode_total_ms() is not None

    while not complete(rec):
        if time.monotonic() > deadline:
            raise TimeoutError(f"request {request_id}: stage updates missing: {rec.stages}")
        await asyncio.sleep(0.01)
        rec = await run.submitter.status.get(request_id) or rec
    return rec


def _vision_ms(bundle: Any, ev: Any, repeat: int = 3) -> float:
    """Median time of the vision tower alone on this request's image (this process, in ms)."""
    from gpu_workers.compute import encode_images

    item = ev.features.kwargs_data["image"][0]
    job = (item["pixel_values"], item["image_grid_thw"])
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        encode_images(bundle, [job])
        times.append((time.perf_counter() - t0) * 1000)
    return Stats(times).p50


async def _one_request(
    run: Any, notifier: Any, bundle: Any, image: Any, salt: str
) -> dict[str, float]:
    """Submit one request, wait for it alone, return its timings in ms."""
    t0 = time.perf_counter()
    ev = await render_request(run, image, salt)
    render_ms = (time.perf_counter() - t0) * 1000
    async with notifier.watch(ev.request_id) as changed:
        start_ms = time.time() * 1000
        cpu0 = time.process_time()
        await run.submitter.submit_rendered(ev)
        rec, seen_ms = await _await_terminal(run, ev.request_id, changed)
        client_cpu_ms = (time.process_time() - cpu0) * 1000
    if rec.status != "completed":
        raise RuntimeError(f"request {ev.request_id} ended {rec.status}: {rec.error}")
    rec = await _settled(run, ev.request_id, rec)
    t = rec.timings
    encoded = rec.encode_events != 0
    vision = await asyncio.to_thread(_vision_ms, bundle, ev) if encoded else 0.0
    e2e = seen_ms - start_ms
    compute = vision + t["prefill_decode"]
    finished = rec.finished_ms or rec.created_ms
    out = {
        "render_ms": render_ms,
        "end_to_end_ms": e2e,
        "model_compute_ms": compute,
        "overhead_ms": e2e - compute,
        "prefill_decode_ms": t["prefill_decode"],
        "fanout_ms": t["fanout"],
        "prefill_queue_ms": t["queue"],
        "embedding_wait_ms": t["embedding_wait"],
        "created_to_finished_ms": float(finished - rec.created_ms),
        "finished_to_seen_ms": seen_ms - finished,
        "overhead_to_finished_ms": finished - rec.created_ms - compute,
        "client_cpu_ms": client_cpu_ms,
    }
    if "admission" in t:  # the prefill worker's reads and checks before the embedding wait
        out["prefill_admission_ms"] = t["admission"]
    if "broker_hop" in t:  # the prefill event's produce -> the prefill worker starts it
        out["prefill_hop_ms"] = t["broker_hop"]
    if encoded:
        out["vision_tower_ms"] = vision
        out["encode_stage_ms"] = next(v for k, v in t.items() if k.startswith("encode."))
        hop = next((v for k, v in t.items() if k.startswith("encode_hop.")), None)
        if hop is not None:  # the encode event's produce -> the encode worker starts it
            out["encode_hop_ms"] = hop
    return out


def _summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: _ms_stats([r[k] for r in rows if k in r]) for k in keys}


@dataclasses.dataclass
class Arm:
    """One broker's pipeline in the interleaved run: its workers, its meter, its client."""

    kind: str
    run: Any
    meter: Any
    notifier: Any
    bundle: Any
    salt: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    seeds: Any = dataclasses.field(default_factory=lambda: iter(range(1000, 100000)))

    async def one(self, image: Any) -> dict[str, float]:
        return await _one_request(self.run, self.notifier, self.bundle, image, self.salt)

    def new_image(self) -> Any:
        from media.sample_images import synthetic_image

        return synthetic_image(IMAGE_SIDE, IMAGE_SIDE, next(self.seeds))


async def _interleaved_sets(arms: list[Arm], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """The miss and hit sets on every arm, one request at a time, the arms taking turns (the
    order swapped every round): a busy neighbour slows both brokers alike, not one block."""
    for arm in arms:
        for _ in range(sizes.warmup):
            await arm.one(arm.new_image())
        await asyncio.to_thread(_vision_ms, arm.bundle, _render(arm.run, IMAGE_SIDE))
    rows: dict[str, dict[str, list[dict[str, float]]]] = {
        a.kind: {"miss": [], "hit": []} for a in arms
    }
    cpu: dict[str, dict[str, Any]] = {a.kind: {} for a in arms}

    async def one_set(case: str, n: int, image_of: Any) -> None:
        for arm in arms:
            arm.meter.restart()
        for i in range(n):
            for arm in arms if i % 2 == 0 else reversed(arms):
                rows[arm.kind][case].append(await arm.one(image_of(arm)))
        for arm in arms:
            cpu[arm.kind][case] = arm.meter.per_request(n)

    await one_set("miss", sizes.misses, lambda arm: arm.new_image())
    repeated = {arm.kind: arm.new_image() for arm in arms}
    for arm in arms:
        await arm.one(repeated[arm.kind])  # puts its embedding in the store
    await one_set("hit", sizes.hits, lambda arm: repeated[arm.kind])
    out = {}
    for arm in arms:
        if any("encode_stage_ms" in h for h in rows[arm.kind]["hit"]):
            raise AssertionError(f"{arm.kind}: a repeated image was encoded again")
        out[arm.kind] = {
            "miss": _summarise(rows[arm.kind]["miss"]),
            "hit": _summarise(rows[arm.kind]["hit"]),
            "cpu_ms_per_request": {
                "what": "CPU ms each of this broker's processes (workers, broker, Redis) spent "
                "per request over the set (requests one at a time, with the gaps between them: "
                "idle fetch polls count too); the client's own CPU from submit to seeing the "
                "outcome is client_cpu_ms above",
                **cpu[arm.kind],
            },
        }
    return out


def _render(run: Any, side: int, seed: int = 3) -> Any:
    from media.sample_images import synthetic_image
    from schemas.types import SamplingParams

    return run.submitter.renderer.render(
        uuid.uuid4().hex,
        prompt=PROMPT,
        images=[synthetic_image(side, side, seed)],
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
    )


# ---------------------------------------------------------------------------------------------
# 2. Prefill-path transport: metadata-only events vs full kwargs_data


async def _transport(settings: Any, topic: str, events: list[Any], compression: str) -> float:
    """Events/s of encode -> produce -> fetch -> decode over one partition (all ``events``)."""
    from aiokafka import TopicPartition

    from runtime.kafka import ensure_topics, make_consumer, make_producer
    from runtime.publisher import frame
    from schemas.codec import get_codec
    from schemas.types import PrefillEvent

    codec = get_codec()
    await ensure_topics(settings, [topic], partitions=1)
    producer = make_producer(settings, compression=compression)
    # A short fetch wait for both variants: the rate should reflect per-event cost, not how
    # long an idle fetch lingers at the end of a short run (see ``kafka_hop``).
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=FAST_FETCH_WAIT_MS)
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        await consumer.position(tp)  # resolve the offset before the clock starts

        async def produce(batch: list[Any]) -> None:
            sent = []
            for ev in batch:
                record = frame(ev, ev.request_id)
                sent.append(
                    await producer.send(
                        topic, value=record.value, key=record.key, headers=record.headers
                    )
                )
            await asyncio.gather(*sent)

        async def consume(n: int) -> None:
            got = 0
            while got < n:
                for rec in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                    decoded = codec.decode(rec.value, PrefillEvent)
                    if decoded.request_id != events[got % len(events)].request_id:
                        raise AssertionError("events came back out of order")
                    got += 1

        warm = events[: min(3, len(events))]
        await asyncio.gather(produce(warm), consume(len(warm)))
        t0 = time.perf_counter()
        await asyncio.gather(produce(events), consume(len(events)))
        return len(events) / (time.perf_counter() - t0)
    finally:
        await producer.stop()
        await consumer.stop()


@contextlib.asynccontextmanager
async def hop_clients(
    settings: Any,
    topic: str,
    *,
    producer_overrides: dict[str, Any] | None = None,
    **consumer_overrides: Any,
) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A one-partition ``topic``, a started producer with the stack's settings and a consumer
    assigned to it from its start: ``(producer, consumer, partition)``, both stopped after."""
    from aiokafka import TopicPartition

    from runtime.kafka import ensure_topics, make_consumer, make_producer

    await ensure_topics(settings, [topic], partitions=1)
    producer = make_producer(settings, **(producer_overrides or {}))
    consumer = make_consumer(settings, group_id=None, **consumer_overrides)
    await producer.start()
    try:
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            await consumer.position(tp)
            yield producer, consumer, tp
        finally:
            await consumer.stop()
    finally:
        await producer.stop()


async def _kafka_hop(
    settings: Any, topic: str, n: int, **consumer_overrides: Any
) -> dict[str, Any]:
    """One small record's hop, taken apart: produce + ack, ack -> the fetch returns it, our
    decode of a real event, hand-off to a handler task (see the module docstring)."""
    from schemas.codec import get_codec

    codec = get_codec()
    event = codec.encode(_sample_prefill_event())
    parts: dict[str, list[float]] = {k: [] for k in HOP_PARTS}
    wait_ms = consumer_overrides.get("fetch_max_wait_ms", settings.kafka_fetch_max_wait_ms)
    async with hop_clients(settings, topic, **consumer_overrides) as (producer, consumer, tp):
        for i in range(n + 1):  # the first is a warm-up
            # Let the consumer settle into idle fetches, then send at a random point of one, as a
            # request does: a fixed pause would land every send at the same phase of the wait.
            await asyncio.sleep(0.02 + random.uniform(0, wait_ms / 1000))
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, value=event)
            t1 = time.perf_counter()
            while not (batch := await consumer.getmany(tp, timeout_ms=2000)).get(tp):
                pass
            t2 = time.perf_counter()
            codec.decode(batch[tp][0].value)
            t3 = time.perf_counter()
            started: asyncio.Future[float] = asyncio.get_running_loop().create_future()

            async def handler(done: asyncio.Future[float] = started) -> None:
                done.set_result(time.perf_counter())

            asyncio.get_running_loop().create_task(handler())
            t4 = await started
            if i == 0:
                continue
            for key, value in zip(
                HOP_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True
            ):
                parts[key].append(value)
    return {
        "fetch_max_wait_ms": wait_ms,
        "event_bytes": len(event),
        **{key: Stats(values).to_json("ms") for key, values in parts.items()},
    }


HOP_PARTS = ("produce_ack", "fetch_answer", "decode", "handoff", "total")
"""The parts of one hop, in order (``total``: produce to the handler starting)."""


def _sample_prefill_event() -> Any:
    """A cached image's PrefillEvent of the benchmark's request (1 image, 64 placeholders)."""
    import torch

    from schemas.types import (
        ECTransfer,
        Features,
        PlaceholderRange,
        PrefillEvent,
        SamplingParams,
    )

    grid = torch.tensor([[1, 16, 16]], dtype=torch.int64)
    h = "a" * 64
    return PrefillEvent(
        request_id=uuid.uuid4().hex,
        model="tiny",
        token_ids=[1] * 10 + [268] * 64 + [2] * 10,
        features=Features(
            {"image": [h]},
            {"image": [PlaceholderRange(10, 64)]},
            None,
            {"image": [{"image_grid_thw": grid}]},
        ),
        ec_transfer_params={
            h: ECTransfer(h, "redis://127.0.0.1:6379/0", f"ec:tiny:{h}", 1, "0" * 64)
        },
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
    )


async def _hops(settings: Any, n: int) -> dict[str, Any]:
    """The Kafka hop with the workers' consumer settings and with a short fetch wait."""
    base = f"{settings.topic_prefix}.bench-hop"
    topics = [f"{base}-default", f"{base}-fast"]
    try:
        default = await _kafka_hop(settings, topics[0], n)
        fast = await _kafka_hop(settings, topics[1], n, fetch_max_wait_ms=FAST_FETCH_WAIT_MS)
    finally:
        await _delete_topics(settings, topics)
    return {
        "what": "one record (a PrefillEvent's bytes), 1 partition, taken apart: produce_ack "
        "(send_and_wait), fetch_answer (from the ack until getmany returns it: the broker "
        "answering the waiting fetch, and aiokafka parsing the response), decode (our codec), "
        "handoff (a handler task starting, as the consume loop dispatches one), total",
        "worker_consumer_settings": default,
        f"fetch_max_wait_{FAST_FETCH_WAIT_MS}ms": fast,
    }


async def _warm_broker(settings: Any, n: int) -> None:
    """``n`` produce -> fetch round trips before anything is timed: a JVM broker's first few
    hundred requests run interpreted (a fresh Apache Kafka answers a produce in 2-3 ms, a warm
    one in under 1), and both brokers get the same warm-up."""
    if n <= 0:
        return
    topic = f"{settings.topic_prefix}.bench-warm"
    try:
        await _kafka_hop(settings, topic, n, fetch_max_wait_ms=FAST_FETCH_WAIT_MS)
    finally:
        await _delete_topics(settings, [topic])


async def _delete_topics(settings: Any, topics: list[str]) -> None:
    """Best effort: the in-memory broker would otherwise keep the baseline's megabytes."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(topics)
    except Exception:
        pass
    finally:
        await admin.close()


async def _throughput(run: Any, renders: list[Any], n: int) -> dict[str, Any]:
    from producers.fanout import FanOut
    from runtime.stores import open_store
    from schemas.codec import get_codec

    store = open_store(f"local://bench-{uuid.uuid4().hex[:12]}")
    fan = FanOut(run.settings, store, run.submitter.fanout.info)
    try:
        ours = [(await fan.plan(ev)).prefill for ev in renders]
    finally:
        await store.close()
    full = [
        dataclasses.replace(
            p, features=dataclasses.replace(p.features, kwargs_data=r.features.kwargs_data)
        )
        for p, r in zip(ours, renders, strict=True)
    ]
    # n events cycling over the distinct requests, each with its own request id.
    ours_n = [dataclasses.replace(ours[i % len(ours)], request_id=f"b{i}") for i in range(n)]
    full_n = [dataclasses.replace(full[i % len(full)], request_id=f"b{i}") for i in range(n)]
    codec = get_codec()
    s = run.settings
    base = f"{s.topic_prefix}.bench-prefill"
    variants = {
        "ours": (ours_n, s.prefill_compression),
        "full_kwargs_same_compression": (full_n, s.prefill_compression),
        "full_kwargs_uncompressed": (full_n, "none"),
    }
    topics = {name: f"{base}-{name}" for name in variants}
    try:
        rates = {
            name: await _transport(s, topics[name], evs, comp)
            for name, (evs, comp) in variants.items()
        }
    finally:
        await _delete_topics(s, list(topics.values()))
    best_base = max(rates["full_kwargs_same_compression"], rates["full_kwargs_uncompressed"])
    return {
        "events": n,
        "distinct_requests": len(renders),
        "prefill_compression": s.prefill_compression,
        "consumer_fetch_max_wait_ms": FAST_FETCH_WAIT_MS,
        "event_bytes": {
            "ours": len(codec.encode(ours[0])),
            "full_kwargs": len(codec.encode(full[0])),
        },
        "requests_per_s": {k: sig(v) for k, v in rates.items()},
        "ratio_vs_full_kwargs": ratio(rates["ours"], best_base),
        "ratio_vs_full_kwargs_same_compression": ratio(
            rates["ours"], rates["full_kwargs_same_compression"]
        ),
    }


# ---------------------------------------------------------------------------------------------


def _service_pids(settings: Any) -> dict[str, int]:
    """The broker's and Redis's processes, where this host can see them."""
    from bench.worker_profile import listener_pid

    out = {}
    broker_port = int(settings.kafka_bootstrap.split(",")[0].rsplit(":", 1)[1])
    for name, port in (("broker", broker_port), ("redis", urlsplit(settings.redis_url).port)):
        pid = listener_pid(port or 6379)
        if pid is not None:
            out[name] = pid
    return out


async def _cleanup_redis(redis_url: str, prefix: str) -> int:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        return len(keys)
    finally:
        await client.aclose()


@dataclasses.dataclass
class Target:
    """One broker to benchmark on: its settings (own topics, Redis, key prefix) and logs."""

    kind: str
    settings: Any
    prefix: str
    log_dir: Path


async def _run_all(targets: list[Target], sizes: Sizes) -> dict[str, Any]:
    """Every target's pipeline up at once; the request sets interleaved across them; then each
    one's idle CPU, broker hop and (the first only) prefill-path throughput."""
    from bench.worker_profile import CpuMeter, WorkerProfiler, idle_cpu
    from epd.local_pipeline import local_pipeline
    from runtime.model import load_model
    from runtime.status import StatusNotifier

    blocks: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        arms: list[Arm] = []
        profilers: dict[str, Any] = {}
        for t in targets:
            await _warm_broker(t.settings, sizes.broker_warmup)
            t0 = time.perf_counter()
            run = await stack.enter_async_context(
                local_pipeline(t.settings, spawn_workers=True, log_dir=t.log_dir)
            )
            stack.push_async_callback(_forget_run, t, run.settings)
            assert run.workers is not None
            pids = {f"{k}-{i}": p.pid for i, (k, p, _) in enumerate(run.workers.procs)}
            notifier = StatusNotifier(run.submitter.status)
            await notifier.start()
            stack.push_async_callback(notifier.close)
            bundle = await asyncio.to_thread(load_model, run.settings.model, device="cpu")
            meter = CpuMeter({**pids, **_service_pids(run.settings)})
            arms.append(Arm(t.kind, run, meter, notifier, bundle))
            blocks[t.kind] = {"startup_s": sig(time.perf_counter() - t0)}
            # Where the overhead goes: each worker sampled by py-spy while the requests run.
            profilers[t.kind] = WorkerProfiler(pids, t.log_dir / "profiles")
        for p in profilers.values():
            p.start()
        try:
            overhead = await _interleaved_sets(arms, sizes)
        finally:
            profiles = {k: await asyncio.to_thread(p.stop) for k, p in profilers.items()}
        for i, arm in enumerate(arms):
            # ...and what waiting costs: CPU of the idle workers (fetch polls, heartbeats) and
            # of the broker and Redis answering them (every pipeline idle meanwhile).
            idle = await asyncio.to_thread(idle_cpu, arm.meter.pids, sizes.idle_s)
            block = blocks[arm.kind]
            block["overhead"] = overhead[arm.kind]
            block["kafka_hop"] = await _hops(arm.run.settings, sizes.hops)
            block["worker_idle_cpu_pct"] = {
                "what": f"% of one core each worker (and the broker and Redis, where visible) "
                f"used over {sizes.idle_s:g} s with no requests",
                "fetch_max_wait_ms": arm.run.settings.kafka_fetch_max_wait_ms,
                **idle,
            }
            block["profile"] = profiles[arm.kind]
            if i == 0:
                renders = [
                    _render(arm.run, IMAGE_SIDE, seed=s) for s in range(7, 7 + min(8, sizes.events))
                ]
                block["throughput"] = await _throughput(arm.run, renders, sizes.events)
    return blocks


async def _forget_run(target: Target, run_settings: Any) -> None:
    """Delete what one target's run left: its Redis keys and its topics."""
    from schemas.topics import Topics

    await _cleanup_redis(target.settings.redis_url, target.prefix)
    await _delete_topics(run_settings, Topics(run_settings.topic_prefix).all())


BROKERS_ENV = "EPD_BENCH_BROKERS"
"""Which brokers the overhead runs on: ``apache,tansu`` (default), one of them, or ``env``."""


def bench_brokers() -> tuple[list[str], dict[str, str]]:
    """(brokers to run on, {broker: why it is skipped})."""
    import os

    from epd.services import kafka

    raw = os.environ.get(BROKERS_ENV, "apache,tansu")
    wanted = [b.strip() for b in raw.split(",") if b.strip()]
    skipped = {}
    if "apache" in wanted and (reason := kafka.unavailable_reason()) is not None:
        skipped["apache"] = reason
    return [b for b in wanted if b not in skipped], skipped


@contextlib.contextmanager
def embedded_broker(kind: str, work: Path) -> Any:
    """A fresh broker of ``kind`` for one benchmark block; yields its ``EPD_*`` lines."""
    from epd import services

    rec = services.start_broker(kind, work, log_dir=work, tie_to_parent=True, fresh=True)
    try:
        yield services.services_env(rec, "", kind) | {"EPD_KAFKA_BOOTSTRAP": rec.address}
    finally:
        services.stop_records([rec])


@contextlib.contextmanager
def private_redis(work: Path) -> Any:
    """A redis-server of this block's own (CPU per request is then this broker's alone);
    yields its URL, or None where redis-server is not installed (the environment's is used)."""
    import shutil

    from epd import services

    if shutil.which("redis-server") is None:
        yield None
        return
    rec = services.start_redis(
        work, f"redis://127.0.0.1:{services.free_port()}/0", log_dir=work, tie_to_parent=True
    )
    try:
        yield rec.address
    finally:
        services.stop_records([rec])


def _judged(blocks: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The block the budget is judged on: Apache Kafka's, else the first there is."""
    name = "apache" if "apache" in blocks else next(iter(blocks))
    return name, blocks[name]


def run(
    *, quick: bool = False, out: Path | None = None, redis_url: str | None = None
) -> dict[str, Any]:
    """Run the pipeline on loopback on each broker, interleaved, and return the report block
    (starts the brokers, and a Redis for each where ``redis-server`` is installed, itself,
    unless ``EPD_BENCH_BROKERS=env``)."""
    sizes = QUICK if quick else FULL
    base = (out / "pipeline-logs") if out else Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    names, skipped = bench_brokers()
    prefixes: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        targets = []
        for kind in names:
            log_dir = base / kind
            log_dir.mkdir(parents=True, exist_ok=True)
            broker_env = None
            if kind != "env":
                broker_env = stack.enter_context(embedded_broker(kind, log_dir))
                own_redis = stack.enter_context(private_redis(log_dir))
                broker_env = {**broker_env, **({"EPD_REDIS_URL": own_redis} if own_redis else {})}
            settings, prefixes[kind] = pipeline_settings(
                (broker_env or {}).get("EPD_REDIS_URL") or redis_url, broker_env
            )
            targets.append(Target(kind, settings, prefixes[kind], log_dir))
        blocks = asyncio.run(_run_all(targets, sizes)) if targets else {}
    if not blocks:
        raise RuntimeError(f"no broker to benchmark on: {skipped or 'none asked for'}")
    judged_on, judged = _judged(blocks)
    miss_p50 = judged["overhead"]["miss"]["overhead_ms"]["p50_ms"]
    hit_p50 = judged["overhead"]["hit"]["overhead_ms"]["p50_ms"]
    throughput = next(b["throughput"] for b in blocks.values() if "throughput" in b)
    tp_ratio = throughput["ratio_vs_full_kwargs"]
    return {
        "request": f"one {IMAGE_SIDE}x{IMAGE_SIDE} image (256 patches, 1.2 MB fp32 pixels, "
        f"claim-checked), {MAX_TOKENS} new tokens, tiny model on CPU",
        "completion_seen_by": "client woken by the status record's change notification "
        "(Redis pub/sub, as the API's long-poll and event stream are), then reading the record",
        "redis_db": REDIS_DB,
        "redis_key_prefixes": prefixes,
        "worker_logs": str(base),
        "judged_on": judged_on,
        "brokers": blocks,
        "skipped_brokers": skipped,
        "side_by_side": {
            kind: {
                "overhead_p50_ms": {
                    case: b["overhead"][case]["overhead_ms"]["p50_ms"] for case in ("miss", "hit")
                },
                "hop_p50_ms": b["kafka_hop"]["worker_consumer_settings"]["total"]["p50_ms"],
                "cpu_ms_per_request": {
                    case: b["overhead"]["cpu_ms_per_request"][case]["total"]
                    for case in ("miss", "hit")
                },
            }
            for kind, b in blocks.items()
        },
        "overhead_p50_ms": miss_p50,
        "overhead_hit_p50_ms": hit_p50,
        "throughput": throughput,
        "throughput_ratio": tp_ratio,
        "headroom": {
            "overhead_p50": headroom(miss_p50, MAX_OVERHEAD_P50_MS, higher_is_better=False),
            "overhead_hit_p50": headroom(hit_p50, MAX_OVERHEAD_P50_MS, higher_is_better=False),
            "throughput_ratio": headroom(tp_ratio, MIN_THROUGHPUT_RATIO, higher_is_better=True),
        },
        "budget": budget(
            "Pipeline overhead (end-to-end minus model compute) p50 <= 5 ms per request on "
            "loopback on Apache Kafka, for a new and for a cached image (requests one at a "
            "time), reported beside Tansu's; throughput vs the same pipeline shipping full "
            "kwargs_data to prefill: higher (judged: prefill-event transport rate vs the faster "
            "full-kwargs variant; model compute is the same)",
            max_overhead_p50_ms=MAX_OVERHEAD_P50_MS,
            min_throughput_ratio=MIN_THROUGHPUT_RATIO,
        ),
        "meets_budget": miss_p50 <= MAX_OVERHEAD_P50_MS
        and hit_p50 <= MAX_OVERHEAD_P50_MS
        and tp_ratio > MIN_THROUGHPUT_RATIO,
    }
