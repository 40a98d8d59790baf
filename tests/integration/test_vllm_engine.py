"""``EPD_ENGINE=vllm`` end to end: workers as processes on a real broker and a real Redis, the
prefill worker driving the stand-in built from vLLM 0.33.0's code (``tests/vllm_standin.py``:
vLLM's own request and response models, a stub engine; not a live vLLM).

A request is encoded by the stand-in's encoder (its entry written into our store, as vLLM's EC
producer would) and completes with the stand-in's tokens (streamed back into our token stream
and status); a cancel reaches the stand-in as ``/inference/v1/abort_requests``; vLLM's 400 is a dead
letter naming rule ``vllm.rejected``; a dropped connection is retried and completes; a deadline
passing mid-generation aborts it too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.vllm_side import use_vllm

use_vllm()

from epd.local_pipeline import LocalRun, local_pipeline  # noqa: E402
from gpu_workers.instant import INSTANT_TEXT  # noqa: E402
from media.sample_images import synthetic_image  # noqa: E402
from runtime.kafka import read_topic  # noqa: E402
from runtime.settings import Settings  # noqa: E402
from schemas.codec import get_codec  # noqa: E402
from schemas.status_record import StatusRecord  # noqa: E402
from schemas.types import DeadLetter, SamplingParams  # noqa: E402
from schemas.vllm_generate import REJECTED_RULE, engine_request_id  # noqa: E402
from tests.vllm_standin import TOKENS_ONLY_STOP, StandIn  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def standin(settings: Settings) -> Iterator[StandIn]:
    # One stand-in plays both instances: the encoder (EC producer: it writes the entries into
    # our store) and the prefill/decode instance (EC consumer).
    with StandIn(store_url=settings.embedding_store_url) as s:
        yield s


@pytest.fixture(scope="module")
async def run(
    settings: Settings, standin: StandIn, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    cfg = settings.model_copy(
        update={
            "model": "instant",
            "engine": "vllm",
            "vllm_prefill_url": standin.url,
            "vllm_encode_url": standin.url,
            "vllm_timeout_s": 10.0,
        }
    )
    log_dir: Path = tmp_path_factory.mktemp("vllm-worker-logs")
    async with local_pipeline(
        cfg, spawn_workers=True, log_dir=log_dir, kinds=("results", "encode", "prefill")
    ) as r:
        yield r


async def _submit(
    run: LocalRun, seed: int, sampling: SamplingParams, deadline_ms: int | None = None
) -> str:
    ev, _ = await run.submitter.submit(
        prompt="Describe <image>.",
        images=[synthetic_image(56, 84, seed=seed)],
        sampling=sampling,
        deadline_ms=deadline_ms,
    )
    return ev.request_id


async def _wait(run: LocalRun, rid: str) -> StatusRecord:
    wait = asyncio.create_task(run.submitter.wait(rid, timeout_s=120))
    while not wait.done():
        assert run.workers is not None
        run.workers.check_alive()
        await asyncio.wait([wait], timeout=0.5)
    return await wait


def _bodies(standin: StandIn, rid: str) -> list[dict]:
    return [b for b in standin.state.requests if b["request_id"] == rid]


async def test_completes_with_the_standins_tokens(run: LocalRun, standin: StandIn) -> None:
    rid = await _submit(run, 1, SamplingParams(max_tokens=9))
    rec = await _wait(run, rid)
    assert rec.status == "completed", rec.error
    assert rec.token_ids == list(INSTANT_TEXT[:9])
    assert rec.text == INSTANT_TEXT[:9].decode()
    (body,) = _bodies(standin, rid)
    hashes = body["features"]["mm_hashes"]["image"]
    assert "kwargs_data" not in body["features"]  # metadata only: no pixel_values to vLLM
    assert set(body["ec_transfer_params"]) == set(hashes)
    assert body["ec_transfer_params"][hashes[0]]["signature"]
    # The encode stage ran on the stand-in's encoder, which wrote the entry into our store.
    assert set(hashes) <= set(standin.state.encoded)
    encodes = [b for b in standin.state.requests if b["request_id"].startswith(f"{rid}-enc-")]
    assert len(encodes) == 1 and encodes[0]["features"]["kwargs_data"]["image"][0]


async def test_a_cancel_reaches_vllm_as_an_abort(run: LocalRun, standin: StandIn) -> None:
    standin.state.token_delay_s = 0.2
    try:
        rid = await _submit(run, 2, SamplingParams(max_tokens=200))
        deadline = time.monotonic() + 60
        while not _bodies(standin, rid) or engine_request_id(rid) not in standin.state.running:
            assert time.monotonic() < deadline, "the request never reached the stand-in"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a few tokens out
        assert await run.submitter.status.cancel(rid)
        while engine_request_id(rid) not in standin.state.aborts:
            assert time.monotonic() < deadline, "no abort reached the stand-in"
            await asyncio.sleep(0.05)
    finally:
        standin.state.token_delay_s = 0.0
    rec = await _wait(run, rid)
    assert rec.status == "cancelled"
    assert engine_request_id(rid) in standin.state.aborted


async def test_vllms_400_is_a_dead_letter_naming_the_rule(run: LocalRun, standin: StandIn) -> None:
    standin.state.tokens_only = True  # refuses stop strings, in vLLM's words
    try:
        rid = await _submit(run, 3, SamplingParams(max_tokens=4, stop=["zz"]))
        rec = await _wait(run, rid)
    finally:
        standin.state.tokens_only = False
    assert rec.status == "rejected"
    assert rec.error is not None and rec.error["rule"] == REJECTED_RULE
    assert "stop strings are not supported" in rec.error["message"]
    topic = f"{run.settings.topic_prefix}.dlq"
    for _ in range(60):
        letters = [
            get_codec().decode(r.value, DeadLetter) for r in await read_topic(run.settings, topic)
        ]
        mine = [d for d in letters if d.key == rid.encode()]
        if mine:
            break
        await asyncio.sleep(0.5)
    assert len(mine) == 1 and mine[0].error.rule == REJECTED_RULE
    assert TOKENS_ONLY_STOP[:40] in mine[0].error.message


async def test_a_dropped_connection_is_retried(run: LocalRun, standin: StandIn) -> None:
    standin.fail_next("drop")
    rid = await _submit(run, 4, SamplingParams(max_tokens=6))
    rec = await _wait(run, rid)
    assert rec.status == "completed", rec.error
    assert rec.token_ids == list(INSTANT_TEXT[:6])  # the retry's tokens, none twice
    assert len(_bodies(standin, rid)) == 2


async def test_a_deadline_passing_while_vllm_generates_aborts_it(
    run: LocalRun, standin: StandIn
) -> None:
    standin.state.token_delay_s = 0.2
    try:
        rid = await _submit(
            run, 5, SamplingParams(max_tokens=200), deadline_ms=int(time.time() * 1000) + 6000
        )
        rec = await _wait(run, rid)
    finally:
        standin.state.token_delay_s = 0.0
    assert rec.status == "expired"
    assert 0 < len(rec.token_ids or []) < 200  # the tokens made before the deadline
    assert engine_request_id(rid) in standin.state.aborts
