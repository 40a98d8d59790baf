"""Big bodies, slow bodies and fetched media against a real ``epd api`` process (issue 27,
defects 4 and 5): the body byte budget, the body deadline, and the per-request total and the
per-process bound of media URL fetches.

The API runs on the test broker and Redis with its limits shrunk (4 MiB bodies, an 8 MiB body
budget, a 3 s body deadline, 3 MiB fetched per request, 2 fetches at once), beside a loopback
image server that counts the fetches it serves at once. Bodies are sent over raw sockets: the
tests hold a body half sent, or trickle it, which an HTTP client does not do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from runtime.settings import Settings
from tests.integration.api_stack import ApiProcess, isolated, start_api

pytestmark = pytest.mark.integration

MB = 1024 * 1024
MAX_BODY = 4 * MB
BUDGET = 8 * MB
BODY_TIMEOUT_S = 3.0
FETCHED_TOTAL = 3 * MB
FETCH_SLOTS = 2
ITEM = MB  # each image the server sends (a PNG signature, then padding)


@dataclass
class CountingServer:
    """Serves ``/img/N.png`` (``ITEM`` bytes, slowly) and counts the fetches in flight."""

    server: ThreadingHTTPServer
    port: int
    served: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.served.clear()
            self.most_in_flight = 0


def counting_server() -> CountingServer:
    holder: list[CountingServer] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            srv = holder[0]
            with srv.lock:
                srv.served.append(self.path)
                srv.in_flight += 1
                srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
            try:
                body = b"\x89PNG\r\n\x1a\n" + b"\0" * (ITEM - 8)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    for i in range(0, len(body), 256 * 1024):  # slow: fetches overlap
                        time.sleep(0.05)  # before each write: done once the last is sent
                        self.wfile.write(body[i : i + 256 * 1024])
            finally:
                with srv.lock:
                    srv.in_flight -= 1

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(CountingServer(srv, int(srv.server_address[1])))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return holder[0]


@pytest.fixture(scope="module")
def images() -> Iterator[CountingServer]:
    srv = counting_server()
    yield srv
    srv.server.shutdown()


@pytest.fixture(scope="module")
def api(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory, images: CountingServer
) -> Iterator[ApiProcess]:
    from runtime.kafka import ensure_topics
    from schemas.topics import Topics

    s = isolated(settings).model_copy(
        update={
            "api_max_body_bytes": MAX_BODY,
            "api_max_image_bytes": 2 * MB,
            "api_body_budget_bytes": BUDGET,
            "api_body_timeout_s": BODY_TIMEOUT_S,
            "api_max_fetched_bytes": FETCHED_TOTAL,
            "api_image_url_concurrency": FETCH_SLOTS,
            "api_image_url_hosts": f"127.0.0.1:{images.port}",
            "api_render_concurrency": 4,
            "ready_stages": "",  # no workers here: readiness must not wait for them
        }
    )
    asyncio.run(ensure_topics(s, Topics(s.topic_prefix).all()))
    proc = start_api(s.to_env(), tmp_path_factory.mktemp("api-bodies") / "api.log")
    try:
        yield proc
    finally:
        proc.stop()


# --------------------------------------------------------------------------- raw HTTP


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    closed: bool
    """The server closed the connection after the answer."""


async def open_body(
    api: ApiProcess, path: str, length: int | None, first: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST whose head (and ``first`` bytes of body) are sent; the rest is the caller's."""
    port = int(api.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + first)
    await writer.drain()
    return reader, writer


async def answer(reader: asyncio.StreamReader, timeout_s: float, *, close: bool = False) -> Answer:
    """The response on ``reader`` and, with ``close``, whether the connection closed after it
    (within 2 s)."""
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        closed = False
        if close:
            with contextlib.suppress(TimeoutError, ConnectionError):
                closed = await asyncio.wait_for(reader.read(1), 2.0) == b""
    return Answer(int(lines[0].split()[1]), headers, json.loads(body or b"{}"), closed)


async def healthz_ms(api: ApiProcess) -> float:
    async with httpx.AsyncClient(timeout=10) as c:
        t0 = time.perf_counter()
        r = await c.get(f"{api.url}/healthz")
        assert r.status_code == 200
        return (time.perf_counter() - t0) * 1000


def rule(a: Answer) -> str:
    return str(a.body["error"].get("rule") or a.body["error"].get("code"))


# ------------------------------------------------------------------------------ defect 4


async def test_big_bodies_past_the_budget_get_503_at_once_and_slow_ones_408(
    api: ApiProcess,
) -> None:
    """Two 4 MiB bodies held half sent take the 8 MiB budget: a third big body is refused at
    once (503 body.budget, Retry-After, its body never read), on every body route, while
    /healthz and small bodies are answered. The held bodies are closed with 408 body.timeout
    once their deadline passes, and the budget is free again."""
    held = [await open_body(api, "/v1/requests", MAX_BODY, b'{"prompt": "') for _ in range(2)]
    await asyncio.sleep(0.5)  # both reserved
    for path in ("/v1/requests", "/v1/chat/completions", "/v1/responses", "/v1/vllm/generate"):
        reader, writer = await open_body(api, path, MAX_BODY - 1, b"{")
        refused = await answer(reader, 5)
        writer.close()
        assert refused.status == 503, (path, refused)
        assert rule(refused) == "body.budget"
        assert int(refused.headers["retry-after"]) >= 1
    assert await healthz_ms(api) < 2000  # answered while the budget is spent
    reader, writer = await open_body(api, "/v1/requests", 3, b"{x}")  # small: no reservation
    small = await answer(reader, 5)
    writer.close()
    assert (small.status, rule(small)) == (400, "body.json")

    t0 = time.monotonic()
    late = [await answer(r, BODY_TIMEOUT_S + 10, close=True) for r, _ in held]
    waited = time.monotonic() - t0
    for a in late:
        assert (a.status, rule(a)) == (408, "body.timeout"), a
        assert a.closed
    assert waited < BODY_TIMEOUT_S + 5
    for _, w in held:
        w.close()

    # The budget came back: a whole big body is read (and refused for what it holds).
    big = json.dumps({"prompt": "x" * (MAX_BODY - 64)}).encode()
    reader, writer = await open_body(api, "/v1/requests", len(big), big)
    whole = await answer(reader, 30)
    writer.close()
    assert (whole.status, rule(whole)) == (413, "request.prompt")


async def test_a_trickling_chunked_body_is_closed_at_its_deadline(api: ApiProcess) -> None:
    """A body without a Content-Length, sent a few bytes at a time, gets 408 body.timeout
    within its deadline (plus a margin) and its connection is closed."""
    reader, writer = await open_body(api, "/v1/chat/completions", None)
    t0 = time.monotonic()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(int(BODY_TIMEOUT_S * 10)):
                writer.write(b"1\r\n \r\n")
                await writer.drain()
                await asyncio.sleep(0.25)

    sender = asyncio.create_task(trickle())
    try:
        late = await answer(reader, BODY_TIMEOUT_S + 10, close=True)
    finally:
        sender.cancel()
        writer.close()
    assert (late.status, rule(late)) == (408, "body.timeout")
    assert late.body["error"]["type"] == "invalid_request_error"  # OpenAI's shape on its route
    assert late.closed
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 5


async def test_a_chunked_body_that_outgrows_the_budget_is_refused_as_it_streams(
    api: ApiProcess,
) -> None:
    """Undeclared lengths reserve as they grow: with two big bodies holding the budget, a
    chunked body is refused (503 body.budget) once it passes the small-body allowance."""
    held = [await open_body(api, "/v1/requests", MAX_BODY, b"{") for _ in range(2)]
    await asyncio.sleep(0.5)
    reader, writer = await open_body(api, "/v1/requests", None)
    chunk = b"x" * (32 * 1024)
    with contextlib.suppress(ConnectionError):
        for _ in range(8):  # 256 KiB: past the 64 KiB a body may take without a reservation
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
    refused = await answer(reader, 10)
    writer.close()
    for _, w in held:
        w.close()
    assert (refused.status, rule(refused)) == (503, "body.budget")
    await asyncio.sleep(1)  # the held bodies' connections close: their reservations go back


# ------------------------------------------------------------------------------ defect 5


def chat(urls: list[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}


async def test_fetched_media_are_held_to_a_total_per_request(
    api: ApiProcess, images: CountingServer
) -> None:
    """Eight 1 MiB images (each under its 2 MiB limit) are 8 MiB fetched for one small body:
    refused with 413 image_url.total once the request's fetches pass 3 MiB together (the item
    that crossed it named), for each of two such requests side by side; the first failure
    stops the request's other fetches."""
    images.reset()
    base = f"http://127.0.0.1:{images.port}"
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as c:
        bodies = [chat([f"{base}/img/{k}-{i}.png" for i in range(8)]) for k in range(2)]
        answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
    for r in answers:
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "image_url.total"
        assert err["param"].startswith("messages[0].content[")
        assert "EPD_API_MAX_FETCHED_BYTES" in err["message"]
    assert len(images.served) < 16  # not every fetch ran


async def test_fetches_within_the_total_all_run_but_never_more_than_the_slots_at_once(
    api: ApiProcess, images: CountingServer
) -> None:
    """Three requests of two 1 MiB images each (2 MiB a request, under the 3 MiB total: the
    total refuses the sum, not each fetch) are all fetched, at most two fetches at once in
    the process (the fake PNGs are refused later, by the decoder)."""
    images.reset()
    base = f"http://127.0.0.1:{images.port}"
    async with httpx.AsyncClient(base_url=api.url, timeout=60) as c:
        bodies = [chat([f"{base}/ok/{k}-{i}.png" for i in (0, 1)]) for k in range(3)]
        answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
    for r in answers:
        assert r.json()["error"]["code"] != "image_url.total", r.text
    assert len(images.served) == 6
    assert images.most_in_flight <= FETCH_SLOTS, images.most_in_flight
