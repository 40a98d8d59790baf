"""The optional decode stage, to the token: prefill workers park each request's KV cache in the
store and hand it over (a DecodeEvent, through the Avro codec), a decode worker continues in
its own batch. 16 concurrent mixed requests of every family equal their solo ``generate``; the
decode rules refuse a forged, misplaced or misshapen KV reference before anything is read; a
cache that expired or vanished is replaced by running the prefill again; vLLM's
``kv_transfer_params`` ride along unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from gpu_workers.context import WorkerContext
from gpu_workers.decode import DecodeWorker
from gpu_workers.kv_handoff import kv_shape
from gpu_workers.prefill import PrefillWorker
from runtime.publisher import InMemoryPublisher
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from schemas.codec import get_codec
from schemas.errors import ValidationError
from schemas.signing import sign_kv
from schemas.topics import Topics
from schemas.types import DecodeEvent, PrefillEvent, RenderEvent, ResultEvent, now_ms
from tests.unit.test_batching import (
    encode_all,
    mixed_requests,
    settings_for,
    solo_generate,
)
from tests.unit.test_families import (
    SPECS,
    bundle_of,
    redis_store,  # noqa: F401  (a fixture)
)


def wire(ev: Any) -> Any:
    return get_codec().decode(get_codec().encode(ev))


async def hand_off(
    spec: str, events: list[RenderEvent], store: RedisStore, settings: Settings
) -> tuple[InMemoryPublisher, list[DecodeEvent], PrefillWorker]:
    """Fan-out, encode, and a prefill worker with the decode stage on: the decode events."""
    pub, prefills = await encode_all(spec, events, store, settings)
    pre = PrefillWorker(WorkerContext(settings, bundle_of(spec), store, pub, worker_id="pre-stage"))
    try:
        await asyncio.gather(*(pre.handle(wire(p)) for p in prefills))
    finally:
        await pre.close()
    topics = Topics(settings.topic_prefix)
    order = {ev.request_id: i for i, ev in enumerate(events)}
    handed = [e for e in pub.events(topics.decode) if isinstance(e, DecodeEvent)]
    return pub, sorted(handed, key=lambda e: order[e.request_id]), pre


def outcomes(pub: InMemoryPublisher, settings: Settings, stage: str) -> dict[str, ResultEvent]:
    out = {}
    for e in pub.events(Topics(settings.topic_prefix).results):
        if isinstance(e, ResultEvent) and e.stage == stage and e.status != "decoding":
            out[e.request_id] = e
    return out


@pytest.mark.parametrize("spec", SPECS)
async def test_sixteen_concurrent_requests_through_the_decode_stage_equal_their_solo_generate(
    spec: str,
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    events = mixed_requests(spec)
    want = {ev.request_id: solo_generate(spec, ev) for ev in events}
    settings = settings_for(namespace, decode_stage=True)
    pub, handed, pre = await hand_off(spec, events, store, settings)
    assert pre.tally.handed_off == len(events) == len(handed) and pre.tally.completed == 0
    # The prefill worker's part: parked, handed over, nothing terminal.
    prefill_updates = outcomes(pub, settings, "prefill")
    assert {e.status for e in prefill_updates.values()} == {"prefilling"}
    shape = kv_shape(bundle_of(spec))
    for ev in handed:
        assert ev.kv is not None and ev.kv.nbytes == shape.bytes_per_position * ev.kv.seq_len
        assert await store.exists(ev.kv.key)
        info = prefill_updates[ev.request_id].info
        assert info["prefill.handoff"] == "decode" and int(info["kv_bytes"]) == ev.kv.nbytes
    dec = DecodeWorker(WorkerContext(settings, bundle_of(spec), store, pub, worker_id="dec-stage"))
    try:
        await asyncio.gather(*(dec.handle(wire(ev)) for ev in handed))
        engine = dec.engine
    finally:
        await dec.close()
    got = outcomes(pub, settings, "decode")
    for ev in events:
        res = got[ev.request_id]
        assert res.status == "completed", res.error
        assert res.token_ids == want[ev.request_id], ev.request_id
        assert res.info["decode.from"] == "kv"
    assert dec.tally.from_kv == len(events) and dec.tally.prefilled_again == 0
    assert engine.largest_batch >= 8
    for ev in handed:  # a finished request's cache is freed at once
        assert ev.kv is not None and not await store.exists(ev.kv.key)


async def _one_handed(
    store: RedisStore, namespace: str, **extra: Any
) -> tuple[Settings, InMemoryPublisher, DecodeEvent, list[int]]:
    events = mixed_requests("tiny")[5:6]  # an image, seeded sampling
    settings = settings_for(namespace, decode_stage=True, **extra)
    pub, (handed,), _ = await hand_off("tiny", events, store, settings)
    return settings, pub, handed, solo_generate("tiny", events[0])


async def _decode(settings: Settings, store: RedisStore, pub: InMemoryPublisher, ev: Any) -> Any:
    dec = DecodeWorker(WorkerContext(settings, bundle_of("tiny"), store, pub, worker_id="dec-one"))
    try:
        await dec.handle(wire(ev))
    finally:
        await dec.close()
    return dec


@pytest.mark.parametrize("how", ["vanished", "expired"])
async def test_a_cache_that_is_gone_is_replaced_by_running_the_prefill_again(
    how: str,
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    settings, pub, ev, want = await _one_handed(store, namespace)
    assert ev.kv is not None
    if how == "vanished":
        await store.delete(ev.kv.key)  # evicted, or its TTL ran out
    else:
        past = dataclasses.replace(ev.kv, expires_ms=now_ms() - 1)
        ev = dataclasses.replace(ev, kv=sign_kv(settings.secret_bytes(), past, ev.request_id))
    dec = await _decode(settings, store, pub, ev)
    assert dec.tally.prefilled_again == 1 and dec.tally.from_kv == 0
    res = outcomes(pub, settings, "decode")[ev.request_id]
    assert res.status == "completed" and res.token_ids == want
    assert res.info["decode.from"] == "prefill"


async def test_forged_misplaced_or_misshapen_kv_references_are_refused_before_any_read(
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    settings, pub, ev, _ = await _one_handed(store, namespace)
    assert ev.kv is not None
    secret = settings.secret_bytes()
    other_rid = "someone-else"
    cases: dict[str, DecodeEvent] = {
        # A signature made up without the secret.
        "kv-signature": dataclasses.replace(ev, kv=dataclasses.replace(ev.kv, signature="00" * 32)),
        # Another request's cache named in this event (signed for that request).
        "kv-key": dataclasses.replace(
            ev,
            kv=sign_kv(
                secret,
                dataclasses.replace(ev.kv, key=ev.kv.key[: -len(ev.request_id)] + other_rid),
                other_rid,
            ),
        ),
        # Shapes that are not the model's, even when signed.
        "kv-shape": dataclasses.replace(
            ev,
            kv=sign_kv(
                secret,
                dataclasses.replace(ev.kv, layers=3, nbytes=ev.kv.nbytes // 2 * 3),
                ev.request_id,
            ),
        ),
        "kv-store": dataclasses.replace(
            ev,
            kv=sign_kv(
                secret, dataclasses.replace(ev.kv, store="redis://elsewhere:6379/0"), ev.request_id
            ),
        ),
        "kv-transfer-params": dataclasses.replace(ev, kv_transfer_params="[1, 2]"),
    }
    for rule, bad in cases.items():
        dec = DecodeWorker(
            WorkerContext(settings, bundle_of("tiny"), store, pub, worker_id="dec-bad")
        )
        try:
            with pytest.raises(ValidationError) as err:
                await dec.handle(wire(bad))
        finally:
            await dec.close()
        assert err.value.rule == rule, (rule, err.value)
        assert dec.tally.completed == 0 and dec.tally.from_kv == 0
    assert outcomes(pub, settings, "decode") == {}
    assert await store.exists(ev.kv.key)  # nothing read, nothing deleted


async def test_vllm_kv_transfer_params_ride_along_unchanged(
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    params = {"do_remote_decode": True, "remote_engine_id": "e1", "remote_block_ids": [[4, 5]]}
    text = json.dumps(params)
    events = [dataclasses.replace(mixed_requests("tiny")[1], kv_transfer_params=text)]
    settings = settings_for(namespace, decode_stage=True)
    _, prefills = await encode_all("tiny", events, store, settings)
    assert isinstance(prefills[0], PrefillEvent) and prefills[0].kv_transfer_params == text
    pub2, (handed,), _ = await hand_off("tiny", events, store, settings)
    assert json.loads(wire(handed).kv_transfer_params) == params
    await _decode(settings, store, pub2, handed)
    assert outcomes(pub2, settings, "decode")[handed.request_id].status == "completed"
