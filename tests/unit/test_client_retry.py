"""The Python client's retries: one loop (no recursion, however many tries), ``Retry-After``
honoured with jitter so throttled clients spread out, broken connections retried only where a
repeat is safe."""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from frontend import client as client_mod
from frontend.client import EPDClient, RetryPolicy, SyncEPDClient, Throttled

ACCEPTED = {"request_id": "r1", "status": "queued", "status_url": "/x", "events_url": "/x/e"}


def answers(script: list[Any]) -> Callable[[httpx.Request], httpx.Response]:
    """A handler answering from ``script`` in order: an int is a status (429s carry
    ``Retry-After: 1``), an exception is raised as a broken connection."""
    calls = iter(script)

    def handle(request: httpx.Request) -> httpx.Response:
        step = next(calls)
        if isinstance(step, Exception):
            raise step
        if step == 429:
            return httpx.Response(
                429, headers={"Retry-After": "1"}, json={"error": {"code": "throttled"}}
            )
        return httpx.Response(step, json=ACCEPTED)

    return handle


def test_retry_after_is_honoured_with_jitter() -> None:
    policy = RetryPolicy()
    rng = random.Random(7)
    delays = [policy.delay(0, "1", rng) for _ in range(200)]
    assert all(1.0 <= d <= 1.5 for d in delays)
    # 200 clients told "1" do not all come back at the same moment
    assert max(delays) - min(delays) > 0.4 and len({round(d, 3) for d in delays}) > 100
    # no header (or one that is not a number): exponential backoff, capped, still jittered
    assert policy.delay(0, None, rng) < policy.delay(4, None, rng) <= 30 * 1.5
    for bad in ("nan", "inf", "-5", "Wed, 21 Oct 2015 07:28:00 GMT", ""):
        d = policy.delay(1, bad, rng)
        assert 0.0 <= d <= policy.max_delay_s * 1.5


def test_sync_client_retries_in_a_loop_and_spreads_its_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    tries = sys.getrecursionlimit() + 50  # a recursive retry would overflow the stack here
    c = SyncEPDClient("http://api", retry=RetryPolicy(retries=tries))
    c._http = httpx.Client(
        base_url="http://api", transport=httpx.MockTransport(answers([429] * tries + [202]))
    )
    assert c.submit(prompt="x") == "r1"
    assert len(slept) == tries and len({round(d, 4) for d in slept}) > 1
    c._http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(answers([429] * 4)))
    c.retry = RetryPolicy(retries=3)
    with pytest.raises(Throttled):
        c.submit(prompt="x")


async def test_async_client_retries_broken_connections_only_when_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(client_mod.asyncio, "sleep", sleep)
    broken = httpx.RemoteProtocolError("Server disconnected without sending a response")
    status = {**ACCEPTED, "created_at": "2026-01-01T00:00:00Z", "stages": {}, "items": []}

    def handler_for(script: list[Any]) -> httpx.MockTransport:
        inner = answers(script)

        def handle(request: httpx.Request) -> httpx.Response:
            resp = inner(request)
            return (
                httpx.Response(resp.status_code, json=status) if request.method == "GET" else resp
            )

        return httpx.MockTransport(handle)

    async with EPDClient("http://api", transport=handler_for([broken, broken, 200])) as c:
        assert (await c.status("r1")).status == "queued"  # a GET is safe to repeat
    async with EPDClient("http://api", transport=handler_for([broken, 202])) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.submit(prompt="x")  # a POST without a key might have been taken: no repeat
    async with EPDClient("http://api", transport=handler_for([broken, 202])) as c:
        assert await c.submit(prompt="x", idempotency_key="k1") == "r1"  # with one it is safe
    assert len(slept) == 3


def test_both_clients_stretch_a_long_polls_read_timeout_from_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sync client read 30 s into every status call whatever its timeout_s; the async one
    # its own: both build the call from the same code now.
    status = {**ACCEPTED, "created_at": "2026-01-01T00:00:00Z", "stages": {}, "items": []}
    seen: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"]["read"])
        return httpx.Response(200, json=status)

    c = SyncEPDClient("http://api", timeout_s=100)
    c._http = httpx.Client(
        base_url="http://api", timeout=100, transport=httpx.MockTransport(handle)
    )
    assert c.status("r1", wait_s=5).status == "queued"

    async def read_async() -> None:
        transport = httpx.MockTransport(handle)
        async with EPDClient("http://api", timeout_s=100, transport=transport) as a:
            await a.status("r1", wait_s=5)

    asyncio.run(read_async())
    assert seen == [115.0, 115.0]


def test_the_event_reader_yields_what_was_asked_for() -> None:
    from frontend.client import StatusEvent, TokenEvent, _SseReader

    lines = ["id: 1", "event: status", 'data: {"status": "decoding", "stage": "decode"}', ""]
    lines += ["id: 2", "event: token", 'data: {"token_ids": [5], "text": "a"}', ""]
    for tokens, kinds in ((False, [StatusEvent]), (True, [StatusEvent, TokenEvent])):
        sse = _SseReader(tokens)
        got = [ev for line in lines if (ev := sse.feed(line)) is not None]
        assert [type(ev) for ev in got] == kinds
