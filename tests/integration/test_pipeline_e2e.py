"""End to end over a real Tansu broker and a real Redis, workers in separate processes.

One pipeline (results, encode and prefill workers as ``epd worker`` processes) serves the whole
module; each test uses requests of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from epd.commands.verify import builtin_cases, verify_cases
from epd.local_pipeline import LocalRun, local_pipeline
from media.sample_images import synthetic_image
from runtime.kafka import KafkaPublisher, read_topic
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.modalities import GRID_FIELDS, metadata_of
from schemas.status_record import StatusRecord
from schemas.types import (
    DeadLetter,
    EncodedEvent,
    PrefillEvent,
    ResultEvent,
    SamplingParams,
    TensorRef,
)

pytestmark = [pytest.mark.integration, pytest.mark.tansu]


OUR_LOGGERS = {"consumers", "gpu_workers", "producers", "runtime", "epd", "schemas", "media"}


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("worker-logs")
    # DEBUG: each stage's per-record "handled" line is one of the log lines the trace test reads
    # (the results collector logs nothing else for a request whose updates were recorded).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPD_LOG_LEVEL", "DEBUG")
        async with local_pipeline(
            settings,
            spawn_workers=True,
            log_dir=log_dir,
            kinds=("results", "encode", "prefill", "router"),
        ) as run:
            yield run


async def _wait_all(run: LocalRun, request_ids: list[str]) -> dict[str, StatusRecord]:
    async def one(rid: str) -> tuple[str, StatusRecord]:
        wait = asyncio.create_task(run.submitter.wait(rid, timeout_s=240))
        while not wait.done():
            assert run.workers is not None
            run.workers.check_alive()  # a crashed worker fails the test with its log
            await asyncio.wait([wait], timeout=1.0)
        return rid, await wait

    return dict(await asyncio.gather(*(one(r) for r in request_ids)))


async def _result_of(run: LocalRun, request_id: str, status: str) -> ResultEvent:
    """The request's ``status`` event on the results topic, once it is there."""
    topic = f"{run.settings.topic_prefix}.results"
    for _ in range(240):
        for rec in await read_topic(run.settings, topic):
            ev = get_codec().decode(rec.value)
            if isinstance(ev, ResultEvent) and (ev.request_id, ev.status) == (request_id, status):
                return ev
        await asyncio.sleep(0.5)
    raise AssertionError(f"no {status} result of {request_id} on {topic}")


async def test_parity_with_monolithic_generate(pipeline: LocalRun) -> None:
    from runtime.model import load_model

    bundle = await asyncio.to_thread(load_model, "tiny", device="cpu")
    results = await verify_cases(pipeline, bundle, builtin_cases(), max_tokens=10, timeout_s=240)
    for r in results:
        assert r.status == "completed", (r.name, r.error)
        assert r.pipeline == r.monolithic, r.name
    assert len(results) == 9  # six image cases, three video cases


async def test_twenty_requests_complete_and_repeats_encode_once(pipeline: LocalRun) -> None:
    salt = uuid.uuid4().hex  # this test's images hash apart from every other test's
    images = [synthetic_image(56 + 14 * (i % 5), 56 + 28 * (i % 3), seed=100 + i) for i in range(6)]
    sampling = SamplingParams(max_tokens=4)
    # 20 requests over 6 distinct images: many repeats, some of them concurrent, and a few
    # two-image prompts (one of which repeats an image inside one request).
    plans: list[tuple[str, list]] = []
    for i in range(20):
        if i % 5 == 4:
            plans.append(("Compare <image> and <image>.", [images[i % 6], images[(i + 1) % 6]]))
        elif i == 7:
            plans.append(("Same twice: <image> <image>", [images[2], images[2]]))
        else:
            plans.append(("Describe <image>.", [images[i % 6]]))

    async def submit(prompt: str, imgs: list) -> tuple[str, list[str]]:
        ev, _ = await pipeline.submitter.submit(
            prompt=prompt, images=imgs, sampling=sampling, cache_salt=salt
        )
        return ev.request_id, ev.features.mm_hashes["image"]

    # two waves: the second repeats images whose embeddings are (or are being) made
    first = await asyncio.gather(*(submit(p, im) for p, im in plans[:10]))
    second = await asyncio.gather(*(submit(p, im) for p, im in plans[10:]))
    submitted = first + second
    outcomes = await _wait_all(pipeline, [rid for rid, _ in submitted])
    assert [o.status for o in outcomes.values()] == ["completed"] * 20, outcomes
    assert all(o.token_ids for o in outcomes.values())

    used = {h for _, hashes in submitted for h in hashes}
    assert len(used) == 6
    # An encoder announces an item (the encoded topic) after storing its embedding, so the
    # prefill worker may finish the request first: the marks may trail the outcomes.
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        encoded = [
            get_codec().decode(r.value, EncodedEvent)
            for r in await read_topic(
                pipeline.settings, f"{pipeline.settings.topic_prefix}.encoded"
            )
        ]
        runs = Counter(e.mm_hash for e in encoded if not e.cache_hit and e.mm_hash in used)
        if set(runs) == used or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    # every distinct image went through the vision tower exactly once
    assert runs == Counter({h: 1 for h in used})

    # The results collector folds the encoded topic into the status records: each image shows
    # as "encoded" on exactly the request that ran it (the record may trail the terminal status).
    runner = {e.mm_hash: e.request_id for e in encoded if not e.cache_hit and e.mm_hash in used}
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        records = {rid: await pipeline.submitter.status.get(rid) for rid in set(runner.values())}
        marked = {h: records[rid].info.get(f"encoded.{h[:12]}") for h, rid in runner.items()}
        if all(v == "encoded" for v in marked.values()):
            break
        assert asyncio.get_running_loop().time() < deadline, marked
        await asyncio.sleep(0.2)
    # Each worker times the broker hop its event came through, from the record's timestamp
    # (the running encoder's is in the mark it writes through).
    for h, rid in runner.items():
        hop = records[rid].encode_hop_ms(h)
        assert hop is not None and 0 <= hop < 60_000, records[rid].timings
    assert all(0 <= o.timings["broker_hop"] < 60_000 for o in outcomes.values())


async def test_prefill_topic_never_carries_pixel_values(pipeline: LocalRun) -> None:
    ev, _ = await pipeline.submitter.submit(
        prompt="Two: <image> <image>",
        images=[synthetic_image(224, 224, seed=7), synthetic_image(84, 56, seed=8)],
        sampling=SamplingParams(max_tokens=2),
    )
    await _wait_all(pipeline, [ev.request_id])
    records = await read_topic(pipeline.settings, f"{pipeline.settings.topic_prefix}.prefill")
    assert records
    for rec in records:
        assert b"pixel_values" not in rec.value
        pf = get_codec().decode(rec.value, PrefillEvent)
        assert pf.features.kwargs_data is None
        # (the topic also holds other tests' requests: video items carry video_grid_thw)
        for modality, items in (pf.features.mm_metadata or {}).items():
            for item in items:
                assert item is not None and GRID_FIELDS[modality] in item
                assert set(item) <= set(metadata_of(modality)), (modality, set(item))
                assert not any(isinstance(v, TensorRef) for v in item.values())
        assert len(rec.value) < 4096


async def test_unsafe_metadata_only_event_is_rejected_and_others_finish(
    pipeline: LocalRun,
) -> None:
    run = pipeline
    good = []
    for seed in (21, 22, 23):
        ev, _ = await run.submitter.submit(
            prompt="Describe <image>.",
            images=[synthetic_image(70, 70, seed=seed)],
            sampling=SamplingParams(max_tokens=3),
        )
        good.append(ev.request_id)
    # An unsafe event straight onto the prefill topic: metadata only, no ec_transfer_params.
    rendered = await run.submitter.renderer.render_async(
        "unsafe-" + uuid.uuid4().hex[:8],
        prompt="Leak <image>",
        images=[synthetic_image(56, 56, seed=24)],
    )
    plan = await run.submitter.fanout.plan(rendered)
    unsafe = dataclasses.replace(plan.prefill, ec_transfer_params={})
    await KafkaPublisher(run.publisher.producer).send(
        f"{run.settings.topic_prefix}.prefill", unsafe.request_id, unsafe
    )

    outcomes = await _wait_all(run, good)
    assert [outcomes[r].status for r in good] == ["completed"] * 3
    # The forged event's request has no record (nothing made it), and its rejection makes
    # none: a stage's update only folds into a record the intake or the router made. The
    # rejection, naming the rule and item, is on the results topic.
    rejected = await _result_of(run, unsafe.request_id, "rejected")
    assert rejected.error is not None and rejected.error.rule == "ec-transfer-required"
    assert rejected.error.modality == "image" and rejected.error.item == 0
    assert await run.submitter.status.get(unsafe.request_id) is None

    letters = [
        get_codec().decode(r.value, DeadLetter)
        for r in await read_topic(run.settings, f"{run.settings.topic_prefix}.dlq")
    ]
    mine = [d for d in letters if d.key == unsafe.request_id.encode()]
    assert len(mine) == 1
    assert mine[0].original_topic == f"{run.settings.topic_prefix}.prefill"
    assert mine[0].error.rule == "ec-transfer-required"
    assert get_codec().decode(mine[0].value, PrefillEvent).request_id == unsafe.request_id


async def test_render_topic_through_the_router_worker(pipeline: LocalRun) -> None:
    # An external renderer's path: a RenderEvent on the render topic, fanned out by the router
    # process (not by the in-process Submitter).
    run = pipeline
    ev = await run.submitter.renderer.render_async(
        "routed-" + uuid.uuid4().hex[:8],
        prompt="Routed <image>",
        images=[synthetic_image(84, 84, seed=31)],
        sampling=SamplingParams(max_tokens=3),
    )
    await KafkaPublisher(run.publisher.producer).send(
        f"{run.settings.topic_prefix}.render", ev.request_id, ev
    )
    outcome = (await _wait_all(run, [ev.request_id]))[ev.request_id]
    assert outcome.status == "completed", outcome
    assert len(outcome.token_ids) == 3
    assert "fanout:encoding" in outcome.stages  # the router's stage update reached the status


async def test_trace_id_flows_from_submit_to_result_and_every_stage_log(
    pipeline: LocalRun,
) -> None:
    """A W3C trace id given at submit appears on the status record and in the JSON log lines
    of every stage that handled the request (router, encode, prefill, results)."""
    import json

    run = pipeline
    assert run.workers is not None
    trace_id = uuid.uuid4().hex
    ev = await run.submitter.renderer.render_async(
        "traced-" + uuid.uuid4().hex[:8],
        prompt="Traced <image>",
        images=[synthetic_image(98, 70, seed=uuid.uuid4().int % 10_000)],
        sampling=SamplingParams(max_tokens=2),
    )
    ev.trace["traceparent"] = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    # Through the render topic, so the router stage handles it too.
    await KafkaPublisher(run.publisher.producer).send(
        f"{run.settings.topic_prefix}.render", ev.request_id, ev
    )
    outcome = (await _wait_all(run, [ev.request_id]))[ev.request_id]
    assert outcome.status == "completed", outcome
    assert outcome.info["trace_id"] == trace_id

    seen: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + 15
    kinds = {"router", "encode", "prefill", "results"}
    while set(seen) != kinds:
        for kind, _, log_path in run.workers.procs:
            for line in log_path.read_text(errors="replace").splitlines():
                if ev.request_id not in line:
                    continue
                rec = json.loads(line)  # every line is one JSON object
                if rec["logger"].split(".")[0] not in OUR_LOGGERS:
                    continue  # a library's DEBUG line that quotes the id (a record key)
                assert rec["request_id"] == ev.request_id
                assert rec["trace_id"] == trace_id, rec
                seen[kind] = seen.get(kind, 0) + 1
        assert asyncio.get_running_loop().time() < deadline, seen
        if set(seen) != kinds:
            await asyncio.sleep(0.5)
