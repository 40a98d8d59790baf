"""Sampling and stop strings, to the token: the disaggregated path (encode -> store-shaped
entries -> prefill -> decode) against transformers' own ``generate`` on the seeded tiny model of
every family, CPU fp32; then through the real encode and prefill workers over Redis, with the
tokens streamed while they decode."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gpu_workers.engine import generate_from_embeddings
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from gpu_workers.sampling import request_seed
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from runtime.token_stream import TokenStreams
from schemas.types import SamplingParams
from tests.unit.test_families import (
    SPECS,
    bundle_of,
    image_items,
    rand_image,
    redis_store,  # noqa: F401  (a fixture the worker test uses)
    renderer_of,
    run_pipeline,
)

N = 24
PARAMS = [
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40},
    {"temperature": 1.3},
    {"temperature": 0.5, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.5},
]


def event(spec: str, rid: str = "s", sampling: SamplingParams | None = None):  # type: ignore[no-untyped-def]
    return renderer_of(spec).render(
        rid, prompt="Tell <image> a story", images=[rand_image(100, 150, 21)], sampling=sampling
    )


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.parametrize("spec", SPECS)
def test_a_seeded_request_equals_transformers_seeded_generate(spec: str, params: dict) -> None:
    bundle = bundle_of(spec)
    ev = event(spec)
    ids, pv, grid = monolithic_inputs(ev)
    items = image_items(bundle, ev)
    sampling = SamplingParams(max_tokens=N, ignore_eos=True, seed=1234, **params)
    want = generate_monolithic(bundle, ids, pv, grid, 0, sampling=sampling)
    got = generate_from_embeddings(bundle, ids, items, 0, sampling=sampling)
    assert got == want and len(got) == N
    # Reproducible, and the seed matters: another seed draws other tokens.
    assert generate_from_embeddings(bundle, ids, items, 0, sampling=sampling) == got
    other = SamplingParams(max_tokens=N, ignore_eos=True, seed=99, **params)
    assert generate_from_embeddings(bundle, ids, items, 0, sampling=other) != got
    greedy = generate_monolithic(bundle, ids, pv, grid, N, ignore_eos=True)
    assert got != greedy


@pytest.mark.parametrize("spec", SPECS)
def test_temperature_zero_is_greedy_as_before(spec: str) -> None:
    bundle = bundle_of(spec)
    ev = event(spec)
    ids, pv, grid = monolithic_inputs(ev)
    items = image_items(bundle, ev)
    want = generate_monolithic(bundle, ids, pv, grid, N, ignore_eos=True)
    zero = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.0, top_k=3, seed=5)
    assert generate_from_embeddings(bundle, ids, items, 0, sampling=zero) == want
    assert generate_from_embeddings(bundle, ids, items, N, ignore_eos=True) == want


def test_an_unseeded_request_draws_a_seed_of_its_own_request() -> None:
    s = SamplingParams(temperature=1.0)
    assert request_seed(s, "a") == request_seed(s, "a") != request_seed(s, "b")
    assert request_seed(SamplingParams(temperature=1.0, seed=7), "a") == 7


def _ascii_windows(tokens: list[int], width: int, start: int = 3) -> list[str]:
    """Printable ASCII windows of the text ``tokens`` make before their first special token
    (the tiny tokenizer: ids >= 256). Stop strings match the visible text, where special
    tokens are skipped, as vLLM matches them; transformers' matches token strings, special
    ones included: the two agree on text without special tokens, which is what a real model
    writes between them."""
    plain = bytes(t for t in itertools.takewhile(lambda t: t < 256, tokens))
    text = plain.decode(errors="replace")
    return [
        text[i : i + width]
        for i in range(start, len(text) - width)
        if all(c.isascii() and c.isprintable() for c in text[i : i + width])
        and text.find(text[i : i + width]) == i
    ]


@pytest.mark.parametrize("spec", ["tiny", "tiny-qwen3-vl"])
def test_stop_strings_end_generation_as_generate_does_and_are_not_returned(spec: str) -> None:
    bundle = bundle_of(spec)
    ev = event(spec)
    ids, pv, grid = monolithic_inputs(ev)
    items = image_items(bundle, ev)
    # The first seed whose text has a few plain windows to stop at (the random tiny model
    # writes special tokens too).
    for seed in range(50):
        base = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.9, seed=seed)
        full = generate_from_embeddings(bundle, ids, items, 0, sampling=base)
        stops = _ascii_windows(full, 2)[:3]
        if len(stops) >= 2:
            break
    assert len(stops) >= 2
    for stop in stops:
        sampling = SamplingParams(
            max_tokens=64, ignore_eos=True, temperature=0.9, seed=seed, stop=[stop, "\x00never"]
        )
        want = generate_monolithic(bundle, ids, pv, grid, 0, sampling=sampling)
        got = generate_from_embeddings(bundle, ids, items, 0, sampling=sampling)
        assert got == want and len(got) < len(full), stop
        assert got == full[: len(got)]
        got_text = bundle.tokenizer.decode(got, skip_special_tokens=True)
        assert got_text.endswith(stop) or stop in got_text


# ------------------------------------------------------------------ the workers, streaming


@pytest.fixture
async def streams() -> AsyncIterator[TokenStreams]:
    client = aioredis.Redis.from_url(Settings().redis_url)
    prefix = f"samp-{uuid.uuid4().hex[:8]}"
    # No flush interval: each decode step's tokens are written as they come, so a stream of
    # some twenty steps is read in several chunks however fast the machine decodes (with 5 ms,
    # a quick run once fitted every step into two writes).
    s = TokenStreams(client, prefix, interval_s=0.0)
    yield s
    await s.close()
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.mark.parametrize("spec", ["tiny", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
async def test_the_workers_sample_stop_and_stream_to_the_token(
    spec: str,
    redis_store: tuple[RedisStore, str],  # noqa: F811
    streams: TokenStreams,
) -> None:
    """A seeded, sampled request with a stop string through fan-out, the real encode and
    prefill workers and Redis: its tokens equal seeded ``generate``'s, its text stops before
    the stop string, and its token stream, read while it decodes, holds exactly its tokens
    and text in several chunks, the first before the request finished."""
    store, namespace = redis_store
    bundle = bundle_of(spec)
    ev0 = event(spec, "probe")
    items = image_items(bundle, ev0)
    for seed in range(100):  # a seed whose text has a plain window well into it to stop at
        probe = SamplingParams(
            max_tokens=200, ignore_eos=True, temperature=0.9, top_k=50, seed=seed
        )
        full = generate_from_embeddings(bundle, ev0.token_ids, items, 0, sampling=probe)
        stops = _ascii_windows(full, 3, start=16)
        if stops:
            break
    text = bundle.tokenizer.decode(full, skip_special_tokens=True)
    stop = stops[0]
    sampling = SamplingParams(
        max_tokens=200, ignore_eos=True, temperature=0.9, top_k=50, seed=seed, stop=[stop]
    )
    rid = f"w-{uuid.uuid4().hex[:8]}"
    ev = event(spec, rid, sampling)
    seen: list[tuple[float, str, list[int]]] = []

    async def follow() -> None:
        async for chunk in streams.follow(rid, idle_timeout_s=60):
            seen.append((time.monotonic(), chunk.text, chunk.token_ids))

    reader = asyncio.create_task(follow())
    await streams.start()
    result, _, _ = await run_pipeline(spec, ev, store, namespace, streams=streams)
    finished = time.monotonic()
    await asyncio.wait_for(reader, 10)
    assert result.status == "completed", result.error
    ids, pv, grid = monolithic_inputs(ev)
    want = generate_monolithic(bundle, ids, pv, grid, 0, sampling=sampling)
    assert result.token_ids == want and len(want) < 200
    assert result.text == text[: text.index(stop)] and stop not in result.text
    assert result.info["finish_reason"] == "stop"
    assert [t for _, _, ts in seen for t in ts] == result.token_ids
    assert "".join(x for _, x, _ in seen) == result.text
    assert len(seen) >= 3 and seen[0][0] < finished
