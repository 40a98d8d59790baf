"""A decode worker killed mid-generation, on the real pipeline (broker, Redis, worker processes:
results, encode, prefill with ``EPD_DECODE_STAGE=true``, two decode workers).

A long request (2,000 tokens, seeded sampling) is streaming from one decode worker when it is
SIGKILLed. Its DecodeEvent was never committed, so the other decode worker gets its partition
after the session timeout and takes the request over: from the parked KV cache, or (second
case: the cache deleted right after the kill, as its TTL would) by running the prefill again
from the embeddings. Each request must end ``completed`` with exactly the tokens of its solo
seeded ``generate``, exactly one terminal status (results topic and record), and a token stream
that holds every token once (the survivor resumes the stream where the dead worker left it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner

from epd.local_pipeline import LocalRun, local_pipeline
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from media.sample_images import synthetic_image
from runtime.kafka import read_topic
from runtime.model import ModelBundle, load_model
from runtime.settings import Settings
from runtime.token_stream import TokenStreams
from schemas.codec import decode
from schemas.keys import kv_key
from schemas.types import TERMINAL_STATUSES, ResultEvent, SamplingParams
from tests.fault.test_scaleout import last_assignment

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "encode", "prefill", "decode", "decode")
MAX_TOKENS = 2000
"""Long enough (seconds of decoding on the tiny model) that the kill lands mid-generation."""
WAIT_S = 120.0
"""Longest a request may take (a takeover waits one session timeout, then decodes again)."""


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("decode-kill-logs")
    cfg = settings.model_copy(update={"decode_stage": True, "max_tokens_limit": MAX_TOKENS})
    async with local_pipeline(cfg, spawn_workers=True, log_dir=log_dir, kinds=KINDS) as run:
        yield run


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


async def _results(run: LocalRun, rid: str) -> list[ResultEvent]:
    recs = await read_topic(run.settings, f"{run.settings.topic_prefix}.results")
    return [e for e in (decode(r.value, ResultEvent) for r in recs) if e.request_id == rid]


def _decoding_worker(run: LocalRun, rid: str) -> int:
    """The index (in ``run.workers``) of the decode worker holding ``rid``'s partition of the
    decode topic: the producer's partitioner on the request id, and each worker's latest
    ``assigned`` log line (read at once, while the request decodes)."""
    assert run.workers is not None
    n = run.settings.topic_partitions
    partition = DefaultPartitioner()(rid.encode(), list(range(n)), list(range(n)))
    topic = f"{run.settings.topic_prefix}.decode"
    owners = [
        i for i in run.workers.indices("decode") if partition in last_assignment(run, i, topic)
    ]
    assert len(owners) == 1, (partition, owners)
    return owners[0]


async def _streamed(streams: TokenStreams, rid: str, at_least: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunks = await streams.read(rid)
        if chunks and chunks[-1].tokens_total >= at_least:
            return chunks[-1].tokens_total
        await asyncio.sleep(0.02)
    raise AssertionError(f"{rid}: fewer than {at_least} tokens streamed in {timeout_s}s")


@pytest.mark.parametrize("cache", ["parked", "expired"])
async def test_a_decode_worker_killed_mid_generation_is_taken_over_to_the_token(
    pipeline: LocalRun, bundle: ModelBundle, cache: str
) -> None:
    run = pipeline
    assert run.workers is not None
    sampling = SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, top_k=40, seed=77
    )
    rid = f"kill-{cache}-{uuid.uuid4().hex[:8]}"
    ev, _ = await run.submitter.submit(
        prompt="Tell a long story about <image>.",
        images=[synthetic_image(56, 56, seed=7 if cache == "parked" else 8)],
        sampling=sampling,
        request_id=rid,
    )
    streams = TokenStreams(run.submitter.status.client, run.settings.topic_prefix)
    before = await _streamed(streams, rid, 50)
    victim = _decoding_worker(run, rid)
    t_kill = time.monotonic()
    run.workers.kill(victim)
    chunks = await streams.read(rid, count=100_000)
    assert not any(c.end for c in chunks), "finished before the kill: make it longer"
    cut = chunks[-1].tokens_total
    if cache == "expired":
        store_key = kv_key(run.settings.ec_namespace, bundle.fingerprint, rid)
        assert await run.submitter.fanout.store.exists(store_key)
        await run.submitter.fanout.store.delete(store_key)
    ids, pv, grid = monolithic_inputs(ev)  # the oracle runs while the survivor takes over
    oracle = asyncio.to_thread(generate_monolithic, bundle, ids, pv, grid, 0, sampling=sampling)
    want, rec = await asyncio.gather(oracle, run.submitter.wait(rid, timeout_s=WAIT_S))
    took = time.monotonic() - t_kill
    try:
        assert rec.status == "completed", rec.error
        assert rec.token_ids == want and len(want) == MAX_TOKENS
        assert rec.info["decode.from"] == ("kv" if cache == "parked" else "prefill")
        # Exactly one terminal status: on the results topic and in the record.
        results = await _results(run, rid)
        terminal = [(e.stage, e.status, e.worker) for e in results if e.status in TERMINAL_STATUSES]
        assert [t[:2] for t in terminal] == [("decode", "completed")], terminal
        victim_pid = run.workers.procs[victim][1].pid
        assert not terminal[0][2].endswith(f":{victim_pid}")  # the survivor finished it
        stages = [k for k in rec.stages if k.split(":", 1)[1] in TERMINAL_STATUSES]
        assert stages == ["decode:completed"]
        # The stream holds each token once, in order, and one end.
        chunks = await streams.read(rid, count=100_000)
        assert [t for c in chunks for t in c.token_ids] == want
        assert [c.end for c in chunks if c.end] == ["completed"]
        assert "".join(c.text for c in chunks) == rec.text
        print(
            f"\n[decode kill, {cache} cache] killed decode worker {victim} after {cut} "
            f"streamed tokens (>= {before} seen); the survivor finished {MAX_TOKENS} tokens "
            f"{took:.1f}s after "
            f"the kill; terminal statuses: {len(terminal)}; stream chunks: {len(chunks)}"
        )
    finally:
        await run.workers.restart(victim)
