"""Token streams (runtime/token_stream.py) on a real Redis, and the pure pieces they carry:
incremental detokenisation and stop strings (runtime/tokenizer.py, gpu_workers/sequence.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import torch

from gpu_workers.sequence import LENGTH, STOP, DecodeState
from runtime.settings import Settings
from runtime.token_stream import TokenStreams
from runtime.tokenizer import IncrementalDetokenizer, build_tiny_tokenizer
from schemas.types import SamplingParams

TOK = build_tiny_tokenizer()


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(Settings().redis_url)
    yield c
    await c.aclose()


@pytest.fixture(params=["redis", "cluster"])
async def streams(
    request: pytest.FixtureRequest, client: aioredis.Redis
) -> AsyncIterator[TokenStreams]:
    """Streams on one Redis, and on a 3-master Redis Cluster (hash-tagged keys, a script per
    write, sharded notifications)."""
    prefix = f"ts-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        from runtime.redis.cluster import cluster_client

        cluster = request.getfixturevalue("redis_cluster")
        on_cluster = cluster_client(cluster.url, max_connections=16)
        s = TokenStreams(on_cluster, prefix, interval_s=0.05, ttl_s=30, max_entries=64)
        yield s
        await s.close()
        await on_cluster.aclose()
        cluster.delete(f"{prefix}:*")
        return
    s = TokenStreams(client, prefix, interval_s=0.05, ttl_s=30, max_entries=64)
    yield s
    await s.close()
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)


async def test_a_fast_decode_is_written_in_few_batches_that_join_to_everything(
    streams: TokenStreams,
) -> None:
    """300 tokens pushed one by one over ~0.3 s (a fast decode): the first goes at once, the
    rest in batches at most one per 50 ms interval; the entries join to every token and all
    the text, in order, and the end entry closes the stream."""
    w = streams.writer("r1")
    t0 = time.monotonic()
    for i in range(300):
        w.push([i % 256], chr(65 + i % 26))
        await asyncio.sleep(0.001)
    elapsed = time.monotonic() - t0
    await w.close("completed", LENGTH)
    chunks = await streams.read("r1")
    assert chunks[-1].end == "completed" and chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == [i % 256 for i in range(300)]
    assert "".join(c.text for c in chunks) == "".join(chr(65 + i % 26) for i in range(300))
    assert chunks[0].token_ids == [0]  # the first token was written alone, at once
    # One write per interval at most (plus the first and the end entry).
    assert 3 <= w.writes <= elapsed / 0.05 + 3, (w.writes, elapsed)
    assert [c.tokens_total for c in chunks] == sorted(c.tokens_total for c in chunks)
    assert chunks[-1].tokens_total == 300 and chunks[-1].chars_total == 300
    ttl = await streams.client.ttl(streams.key("r1"))
    assert 0 < ttl <= 30


async def test_tokens_waiting_for_their_interval_go_out_with_the_end_entry(
    streams: TokenStreams,
) -> None:
    """A short answer: its first token at once, the rest (still inside the interval when it
    ends) in the end entry itself, not an entry of their own before it."""
    w = streams.writer("short")
    w.push([72], "H")
    await asyncio.sleep(0.01)  # the first write is out; the drain now waits for the interval
    w.push([105, 33], "i!")
    await w.close("completed", STOP)
    chunks = await streams.read("short")
    assert [(c.token_ids, c.text, c.end) for c in chunks] == [
        ([72], "H", None),
        ([105, 33], "i!", "completed"),
    ]
    assert w.writes == 2 and chunks[-1].tokens_total == 3 and chunks[-1].finish_reason == "stop"


async def test_a_waiting_reader_wakes_on_the_write_not_its_timeout(
    streams: TokenStreams,
) -> None:
    await streams.start()
    assert await streams.wait("r2", "0", timeout_s=0.1) == []  # nothing yet: times out
    waiting = asyncio.create_task(streams.wait("r2", "0", timeout_s=30))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    t0 = time.monotonic()
    streams.writer("r2").push([7, 8], "hi")
    (chunk,) = await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - t0 < 1.0
    assert (chunk.token_ids, chunk.text, chunk.end) == ([7, 8], "hi", None)
    # resuming after it: nothing new, so the next wait returns the later write only
    w = streams.writer("r2")
    await w.resume()
    w.push([7, 8, 9], "hi!")
    await w.close("completed", STOP)
    later = await streams.wait("r2", chunk.id, timeout_s=5)
    # (closed at once: the new token rides in the end entry)
    assert [(c.token_ids, c.text, c.end) for c in later] == [([9], "!", "completed")]
    assert [c async for c in streams.follow("r2", chunk.id, idle_timeout_s=1)][-1].end == (
        "completed"
    )


async def test_a_retried_request_continues_its_stream_instead_of_repeating_it(
    streams: TokenStreams,
) -> None:
    """The first attempt streams 10 tokens and dies; the retry makes the same tokens again
    (deterministic decoding) and resumes: the stream holds each token once."""
    tokens = list(range(30, 50))
    text = "".join(chr(t) for t in tokens)
    first = streams.writer("r3")
    for t in tokens[:10]:
        first.push([t], chr(t))
    await asyncio.sleep(0.2)
    await first.abandon()
    second = streams.writer("r3")
    assert await second.resume() == 10
    for t in tokens:
        second.push([t], chr(t))
    await second.close("completed", LENGTH)
    chunks = await streams.read("r3")
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert "".join(c.text for c in chunks) == text
    assert sum(c.end is not None for c in chunks) == 1


async def test_the_stream_is_bounded_in_length(streams: TokenStreams) -> None:
    unthrottled = TokenStreams(streams.client, streams.prefix, interval_s=0, max_entries=64)
    w = unthrottled.writer("r4")
    for i in range(400):
        w.push([i], "x")
        await asyncio.sleep(0)
    await w.close("completed", LENGTH)
    # Approximate trimming drops whole stream nodes only: what stays is at most the cap plus
    # one node (stream-node-max-entries, 100 by default); 2 x 64 was crossed under load.
    assert await streams.client.xlen(streams.key("r4")) <= 64 + 100
    assert (await streams.read("r4"))[-1].tokens_total == 400  # the counts tell what was cut
    await unthrottled.close()


async def test_on_a_cluster_a_stream_sits_in_its_requests_slot(
    streams: TokenStreams,
) -> None:
    """The token stream and its channel share the request's hash tag with its status record,
    so a write is one script on one shard; a reader's channel is let go after it leaves."""
    if not streams.cluster:
        pytest.skip("one Redis: no slots")
    from runtime.redis.cluster import slot_of
    from runtime.token_stream import LINGER_S
    from schemas.keys import RedisKeys

    keys = RedisKeys(streams.prefix, cluster=True)
    for rid in ("r6", "a{b}c", ""):
        slot = slot_of(keys.status(rid))
        assert slot_of(streams.key(rid)) == slot == slot_of(keys.token_changes(rid))
        assert slot_of(keys.status_events(rid)) == slot
    assert await streams.wait("r6", "0", timeout_s=0.05) == []
    assert streams.following("r6")  # lingers a while after the reader left
    await asyncio.sleep(LINGER_S + 0.3)
    assert not streams.following("r6")


async def test_a_guarded_writer_writes_nothing_once_the_record_went(
    streams: TokenStreams,
) -> None:
    """Issue 27 #8: a worker's writer is guarded by the request's status record (one script
    checks it exists and appends): while the record is there tokens land; once it went (TTL,
    eviction, an operator) nothing is written, no stream is made again where there was none,
    no end entry says ``completed``, and the writer tells ``on_gone`` once."""
    from schemas.keys import RedisKeys

    keys = RedisKeys(streams.prefix, cluster=streams.cluster)
    rid = f"g-{uuid.uuid4().hex[:8]}"
    await streams.client.set(keys.status(rid), b"{}", ex=60)
    told: list[str] = []
    w = streams.writer(rid, told.append)
    w.push([1], "a")
    await asyncio.sleep(0.2)
    assert [c.token_ids for c in await streams.read(rid)] == [[1]]
    await streams.client.delete(keys.status(rid), streams.key(rid))
    w.push([2], "b")
    await asyncio.sleep(0.2)
    w.push([3], "c")
    await w.close("completed", LENGTH)
    assert await streams.client.exists(streams.key(rid)) == 0
    assert w.gone and told == [rid] and w.writes == 1
    # An unguarded writer (no record in its deployment) writes as ever.
    free = streams.writer(f"u-{uuid.uuid4().hex[:8]}")
    free.push([4], "d")
    await free.close("completed", LENGTH)
    assert free.writes == 1 and not free.gone  # the token and the end in one entry
    assert [(c.token_ids, c.end) for c in await streams.read(free.request_id)] == [
        ([4], "completed")
    ]


async def test_the_two_streams_ids_are_one_order_without_ties(streams: TokenStreams) -> None:
    """A request's status changes and its tokens are written within the same millisecond all
    the time; with the server clock's ``*`` ids each stream started its own sequence at 0 in a
    millisecond, and a status change and a token got equal ids, so no reader could tell which
    came first (a live feed and its replay then disagreed). Written interleaved, as a worker
    writes them, the ids of both streams sort into exactly the order of the writes, and one
    read of both (``read_both``) sees them that way, from any position."""
    from runtime.status.store import StatusStore
    from schemas.types import ResultEvent

    status = StatusStore(streams.client, prefix=streams.prefix, ttl_s=30)
    for n in range(20):
        rid = f"o-{n}-{uuid.uuid4().hex[:6]}"
        written: list[str] = []
        await status.create(rid, {})
        written.append("queued")
        for i, stage in enumerate(["encoding", "prefilling", "decoding"]):
            await streams.append(rid, {"t": str(i), "x": "", "n": str(i + 1), "c": "0"})
            written.append(f"t{i}")
            await status.apply(ResultEvent(rid, "w", stage))
            written.append(stage)
        both = await streams.read_both(rid, "0", "0")
        entries = [(c.id, c.token_ids) for c in both.chunks]
        entries += [(i, status_name(f)) for i, f in both.changes]
        ordered = sorted(entries, key=lambda e: tuple(int(p) for p in e[0].split("-")))
        keys = [tuple(int(p) for p in i.split("-")) for i, _ in ordered]
        assert len(set(keys)) == len(keys), ordered  # no two entries share an id
        got = [f"t{what[0]}" if isinstance(what, list) else what for _, what in ordered]
        assert got == written, ordered
        # From a position inside the feed: exactly what follows it, in the same order.
        token_at = both.chunks[0].id
        status_at = next(i for i, f in both.changes if status_name(f) == "encoding")
        rest = await streams.read_both(rid, status_at, token_at)
        assert [c.token_ids for c in rest.chunks] == [[1], [2]]
        assert [status_name(f) for _, f in rest.changes] == ["prefilling", "decoding"]


async def test_one_read_of_both_streams_never_takes_a_change_past_its_unread_tokens(
    streams: TokenStreams,
) -> None:
    """``read_both`` reads at most ``count`` token entries: a status change written after the
    last of them is left for the next read (``more``), since tokens written before it may not
    be read yet; read on, nothing is skipped or reordered."""
    from runtime.status.store import StatusStore
    from schemas.types import ResultEvent

    status = StatusStore(streams.client, prefix=streams.prefix, ttl_s=30)
    rid = f"m-{uuid.uuid4().hex[:8]}"
    await status.create(rid, {})
    for i in range(5):
        await streams.append(rid, {"t": str(i), "x": "", "n": str(i + 1), "c": "0"})
    await status.apply(ResultEvent(rid, "w", "decoding"))
    first = await streams.read_both(rid, "0", "0", count=3)
    assert first.more and [c.token_ids for c in first.chunks] == [[0], [1], [2]]
    assert [status_name(f) for _, f in first.changes] == ["queued"]
    rest = await streams.read_both(rid, first.changes[-1][0], first.chunks[-1].id, count=3)
    assert not rest.more and [c.token_ids for c in rest.chunks] == [[3], [4]]
    assert [status_name(f) for _, f in rest.changes] == ["decoding"]


def status_name(fields: dict[object, object]) -> str:
    from runtime.status.store import change_data

    return str(change_data(fields)["status"])  # type: ignore[arg-type]


async def test_a_failed_write_never_reaches_the_decode_loop() -> None:
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    w = TokenStreams(dead, "dead", interval_s=0).writer("r5")
    w.push([1], "a")  # returns at once; the write fails in the background
    await w.close("completed", LENGTH)  # bounded, logged, no exception
    assert w.writes == 0
    await dead.aclose()


# ------------------------------------------------------------------ detokenising, stop strings


def test_a_character_split_across_tokens_is_never_emitted_half() -> None:
    text = "a😀b€é—z"
    ids = list(text.encode())  # the tiny tokenizer: one token per byte
    detok = IncrementalDetokenizer(TOK)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == text == TOK.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1:5] == ["", "", "", "😀"]  # four bytes, one character, given whole


def test_special_tokens_and_a_truncated_character_decode_as_the_full_decode_does() -> None:
    eos = TOK.convert_tokens_to_ids("<|endoftext|>")
    ids = [*b"ok", eos, *"😀".encode()[:2]]  # ends in the middle of a character
    detok = IncrementalDetokenizer(TOK)
    joined = "".join(detok.push(t) for t in ids) + detok.finish()
    assert joined == TOK.decode(ids, skip_special_tokens=True)


def state(**sampling: object) -> DecodeState:
    return DecodeState.start(
        "r", SamplingParams(**sampling), TOK, eos_token_id=256, device=torch.device("cpu")
    )  # type: ignore[arg-type]


def feed(seq: DecodeState, text: str) -> list[tuple[list[int], str]]:
    out = []
    for t in text.encode():
        if seq.done:
            break
        seq.accept(t)
        out.append(seq.take_new())
    return out


def test_a_stop_string_across_tokens_ends_generation_and_is_cut() -> None:
    seq = state(max_tokens=100, stop=["END"], ignore_eos=True)
    streamed = feed(seq, "hello ENDING more")
    assert seq.finish_reason == STOP and seq.text == "hello "
    assert seq.tokens == list(b"hello END")  # the token completing the stop string is kept
    joined = "".join(x for _, x in streamed)
    assert joined == "hello " and "E" not in joined  # "E", "EN" were held back, never sent


def test_text_held_back_for_a_possible_stop_string_goes_out_once_it_is_not_one() -> None:
    seq = state(max_tokens=100, stop=["</s>"], ignore_eos=True)
    streamed = feed(seq, "a</b>")
    assert [x for _, x in streamed] == ["a", "", "", "</b", ">"]
    assert not seq.done


def test_max_tokens_and_stop_tokens_end_generation() -> None:
    seq = state(max_tokens=3, ignore_eos=True)
    feed(seq, "abcdef")
    assert (seq.tokens, seq.text, seq.finish_reason) == (list(b"abc"), "abc", LENGTH)
    seq = state(max_tokens=10, stop_token_ids=[ord("c")])
    feed(seq, "abcdef")
    assert (seq.tokens, seq.finish_reason) == (list(b"abc"), STOP)
