"""The front door as an attacker and a newcomer found it (issue 21), through the HTTP API against
real services: a broker, Redis, worker processes and two ``epd api`` replicas sharing them, one
with tenants' tokens and one open (no tokens), with the same EC secret."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from media.sample_images import png_bytes, synthetic_image
from runtime.settings import Settings
from tests.integration.api_stack import (
    ApiProcess,
    ApiStack,
    api_stack,
    auth,
    isolated,
    start_api,
)

pytestmark = pytest.mark.integration

TERMINAL = {"completed", "failed", "rejected", "expired", "cancelled"}
MB = 1024 * 1024


@pytest.fixture(scope="module")
def stack(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    log_dir = tmp_path_factory.mktemp("api-hardening")
    with api_stack(isolated(settings), log_dir) as s:
        open_env = {k: v for k, v in s.env.items() if k != "EPD_API_TOKENS"}
        s.extra.append(start_api(open_env, log_dir / "api-open.log"))
        try:
            yield s
        finally:
            for p in s.extra:
                p.stop()


def open_replica(stack: ApiStack) -> ApiProcess:
    """The replica started without tokens (same Redis, topics and EC secret)."""
    return stack.extra[0]


@pytest.fixture
async def http(stack: ApiStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.api.url, headers=auth(), timeout=60) as c:
        yield c


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png(seed: int, side: int = 56) -> bytes:
    return png_bytes(synthetic_image(side, side, seed=seed))


async def wait_terminal(http: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    for _ in range(60):
        r = await http.get(f"/v1/requests/{rid}", params={"wait": 10})
        assert r.status_code == 200, r.text
        if r.json()["status"] in TERMINAL:
            return dict(r.json())
    raise AssertionError(f"{rid} never finished")


def refused(r: httpx.Response, status: int, rule: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["rule"] == rule, err
    return dict(err)


def vllm_body(seed: int, **extra: Any) -> dict[str, Any]:
    """A vLLM render response of one image, rendered by this pipeline's renderer."""
    from producers.render import Renderer
    from runtime.model import load_render_info
    from schemas.vllm_wire import GenerateRequest, generate_request_to_json

    ev = Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096).render(
        "vllm", prompt="From vLLM <image>", images=[synthetic_image(56, 56, seed=seed)]
    )
    req = GenerateRequest(
        token_ids=ev.token_ids,
        features=ev.features,
        sampling_params={"max_tokens": 2, "temperature": 0},
        request_id=f"vllm-{seed}",
    )
    return {**generate_request_to_json(req), **extra}


class Footprint:
    """What a refused request could leave behind: Redis memory, status records, and records
    on the encode and DLQ topics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def sample(self) -> dict[str, int]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.settings.redis_url)
        try:
            info = await client.info("memory")
            records = [
                k async for k in client.scan_iter(match=f"{self.settings.topic_prefix}:status:*")
            ]
        finally:
            await client.aclose()
        return {
            "redis_used_memory": int(info["used_memory"]),
            "status_records": len(records),
            "encode_records": await self._end(f"{self.settings.topic_prefix}.encode"),
            "dlq_records": await self._end(f"{self.settings.topic_prefix}.dlq"),
        }

    async def _end(self, topic: str) -> int:
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap)
        await admin.start()
        await consumer.start()
        try:
            [described] = await admin.describe_topics([topic])
            parts = [p["partition"] for p in described["partitions"]]
            assert parts, described
            ends = await consumer.end_offsets([TopicPartition(topic, p) for p in parts])
            return sum(ends.values())
        finally:
            await consumer.stop()
            await admin.close()


# ---------------------------------------------------------------------- 1. sizes reach Redis


async def test_oversized_fields_are_refused_and_redis_memory_stays_flat(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    foot = Footprint(stack.settings)
    before = await foot.sample()
    big = "x" * (3 * MB)  # under the stack's 4 MiB body limit
    answers = [
        await http.post("/v1/requests", json={"prompt": "hi", "metadata": {"k": big}}),
        await http.post("/v1/requests", json={"prompt": "hi", "metadata": {big[:300]: "v"}}),
        await http.post(
            "/v1/requests",
            json={"prompt": "hi", "metadata": {f"k{i}": "v" * 255 for i in range(16)}},
        ),
        await http.post("/v1/requests", json={"prompt": "hi", "cache_salt": big}),
        await http.post("/v1/vllm/generate", json=vllm_body(1, request_id=big)),
        await http.post("/v1/vllm/generate", json=vllm_body(2, cache_salt="s" * 5000)),
    ]
    after = await foot.sample()
    growth = after["redis_used_memory"] - before["redis_used_memory"]
    print(
        f"\nREDIS used_memory before={before['redis_used_memory']} "
        f"after={after['redis_used_memory']} growth={growth} B; status records "
        f"{before['status_records']} -> {after['status_records']}; answers "
        f"{[r.status_code for r in answers]}"
    )
    rules = ["request.metadata"] * 3 + ["request.cache_salt", "request.request_id"]
    for r, rule in zip(answers, [*rules, "request.cache_salt"], strict=True):
        refused(r, 413, rule)
    assert growth < 1 * MB, (before, after)
    assert after["status_records"] == before["status_records"]
    assert after["encode_records"] == before["encode_records"]


# ------------------------------------------------------------- 2. half-enqueued vLLM requests


async def test_a_refused_vllm_request_leaves_no_record_and_no_encode_work(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    foot = Footprint(stack.settings)
    before = await foot.sample()
    # beyond int64 (the wire's long), beyond the vocabulary, negative (the validator's rule)
    cases = [(2**63, "render.token_ids"), (2**63 - 1, "render.token_ids"), (-1, "token-ids")]
    answers = []
    for bad_id, _ in cases:
        body = vllm_body(3)
        body["token_ids"] = [*body["token_ids"][:-1], bad_id]
        answers.append(await http.post("/v1/vllm/generate", json=body))
    await asyncio.sleep(1.0)  # an encode event sent by mistake would have landed by now
    after = await foot.sample()
    print(f"\nREFUSED vLLM: {[r.status_code for r in answers]} before={before} after={after}")
    for r, (_, rule) in zip(answers, cases, strict=True):
        refused(r, 422, rule)
    assert after["status_records"] == before["status_records"]
    assert after["encode_records"] == before["encode_records"]
    assert "Traceback" not in stack.api.tail()


# --------------------------------------------------------------- 3. forged tenant salts


async def test_a_forged_tenant_salt_through_an_open_replica_gets_no_cache_hit(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    image = data_url(png(401))
    body = {"prompt": "Mine <image>", "images": [image], "max_tokens": 2}
    first = await http.post("/v1/requests", json=body)
    assert first.status_code == 202, first.text
    alice = await wait_terminal(http, first.json()["request_id"])
    assert alice["status"] == "completed"
    again = await http.post("/v1/requests", json=body)
    assert (await wait_terminal(http, again.json()["request_id"]))["items"][0]["cache_hit"]
    async with httpx.AsyncClient(base_url=open_replica(stack).url, timeout=60) as anyone:
        # the old plain-text derivation, the tenant's name alone, and no salt at all
        for forged in ('tenant:["alice", null]', "alice", None):
            r = await anyone.post("/v1/requests", json={**body, "cache_salt": forged})
            assert r.status_code == 202, r.text
            got = await wait_terminal(anyone, r.json()["request_id"])
            print(f"\nFORGED salt {forged!r}: cache_hit={got['items'][0]['cache_hit']}")
            assert got["status"] == "completed"
            assert got["items"][0]["cache_hit"] is False
            assert got["items"][0]["mm_hash"] != alice["items"][0]["mm_hash"]


# ----------------------------------------------------------- 6. deeply nested JSON, 7. limits


async def test_deeply_nested_json_is_400_on_every_submit_route(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    deep = "[" * 5000 + "]" * 5000
    deep_obj = '{"a":' * 5000 + "1" + "}" * 5000
    shallow_but_deep = json.dumps(_nest(60))  # parses, but deeper than EPD_API_MAX_JSON_DEPTH
    bodies = [
        ("/v1/requests", f'{{"prompt": "x", "metadata": {deep_obj}}}'),
        ("/v1/requests", f'{{"prompt": "x", "token_ids": {deep}}}'),
        ("/v1/requests", f'{{"prompt": "x", "metadata": {shallow_but_deep}}}'),
        ("/v1/vllm/generate", f'{{"token_ids": [1], "features": {deep_obj}}}'),
        ("/v1/vllm/generate", f'{{"token_ids": [1], "sampling_params": {shallow_but_deep}}}'),
        ("/v1/vllm/generate", deep),
    ]
    for path, text in bodies:
        r = await http.post(path, content=text, headers={"content-type": "application/json"})
        refused(r, 400, "body.json")
    parts = {"prompt": (None, "x"), "metadata": (None, deep_obj)}  # multipart, no file
    form = await http.post("/v1/requests", files=parts)
    refused(form, 400, "body.json")
    assert (await http.get("/healthz")).status_code == 200
    assert "Traceback" not in stack.api.tail() and "RecursionError" not in stack.api.tail()


def _nest(depth: int) -> Any:
    node: Any = "leaf"
    for _ in range(depth):
        node = {"n": node}
    return node


async def test_every_route_is_held_to_the_same_limits(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    foot = Footprint(stack.settings)
    before = await foot.sample()
    s = Settings()  # the limits the stack runs with (the API's own defaults)
    many = vllm_body(5)
    for key in ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"):
        slots = many["features"].get(key)
        if slots:
            slots["image"] = slots["image"] * (s.api_max_images + 1)
    refused(await http.post("/v1/vllm/generate", json=many), 413, "image.count")
    images = [data_url(png(7))] * (s.api_max_images + 1)
    refused(
        await http.post("/v1/requests", json={"prompt": "x", "images": images}), 413, "image.count"
    )
    # salts: too long, or not a string, on both routes
    refused(
        await http.post("/v1/vllm/generate", json=vllm_body(6, cache_salt=5)), 422, "request.schema"
    )
    refused(
        await http.post("/v1/requests", json={"prompt": "x", "cache_salt": 5}),
        422,
        "request.schema",
    )
    # max_tokens: true is not 1; beyond EPD_MAX_TOKENS_LIMIT (what the workers allow) is refused
    for value, rule in ((True, "request.schema"), (s.max_tokens_limit + 1, "max-tokens")):
        sp = {"max_tokens": value, "temperature": 0}
        refused(
            await http.post("/v1/vllm/generate", json=vllm_body(8, sampling_params=sp)), 422, rule
        )
        r = await http.post("/v1/requests", json={"prompt": "x", "max_tokens": value})
        refused(r, 422, rule)
    # 8. the context and the vocabulary are the door's to check, not the DLQ's
    refused(await http.post("/v1/requests", json={"prompt": "y" * 65_536}), 422, "context-length")
    body = vllm_body(9)
    body["token_ids"] = [*body["token_ids"][:-1], 10**6]
    refused(await http.post("/v1/vllm/generate", json=body), 422, "render.token_ids")
    refused(
        await http.post("/v1/requests", json={"token_ids": [1, 10**6]}), 422, "render.token_ids"
    )
    after = await foot.sample()
    assert after["dlq_records"] == before["dlq_records"], (before, after)
    assert after["status_records"] == before["status_records"]


# ----------------------------------------------------------------- 10. encode timing, 12. words


async def test_a_completed_request_shows_when_its_encode_finished(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    foot = Footprint(stack.settings)
    before = await foot.sample()
    r = await http.post(
        "/v1/requests",
        json={"prompt": "Time <image> <image>", "images": [data_url(png(11)), data_url(png(12))]},
    )
    assert r.status_code == 202, r.text
    done = await wait_terminal(http, r.json()["request_id"])
    enc = done["stages"]["encode"]
    assert done["status"] == "completed"
    assert enc["started"] is not None and enc["finished"] is not None and enc["ms"] > 0, enc
    assert enc["finished"] >= enc["started"]
    # the footprint the refusal tests rely on does see an accepted request's encode events
    assert (await foot.sample())["encode_records"] == before["encode_records"] + 2


async def test_errors_name_their_cause(http: httpx.AsyncClient) -> None:
    nan = await http.post(
        "/v1/requests",
        content=b'{"prompt": "x", "temperature": NaN}',
        headers={"content-type": "application/json"},
    )
    assert "NaN" in refused(nan, 400, "body.json")["message"]
    form = await http.post(
        "/v1/requests", files={"prompt": (None, "x"), "deadline_s": (None, "nan")}
    )
    assert "finite" in refused(form, 422, "request.schema")["message"]
    urlsafe = base64.urlsafe_b64encode(png(13) + b"\xfb\xff\xfe").decode()
    r = await http.post("/v1/requests", json={"prompt": "<image>", "images": [urlsafe]})
    assert "URL-safe" in refused(r, 400, "image.encoding")["message"]
    block = "<|vision_start|><|image_pad|><|vision_end|>"
    r = await http.post(
        "/v1/requests", json={"prompt": f"{block} and <image>", "images": [data_url(png(14))]}
    )
    assert block in refused(r, 422, "render.marker_count")["message"]
    from tests.unit.test_render import png_header_only

    huge = data_url(png_header_only(30000, 30000))
    r = await http.post("/v1/requests", json={"prompt": "<image>", "images": [huge]})
    assert "EPD_MAX_IMAGE_PIXELS" in refused(r, 413, "render.image_too_large")["message"]
    bmp = io.BytesIO()
    synthetic_image(56, 56, seed=15).save(bmp, format="BMP")
    r = await http.post(
        "/v1/requests",
        json={"prompt": "<image>", "images": [data_url(bmp.getvalue(), "image/bmp")]},
    )
    assert r.status_code == 202, r.text
    assert (await wait_terminal(http, r.json()["request_id"]))["status"] == "completed"


# ---------------------------------------------------------------- 11. the client under load


def test_eighty_threads_against_a_small_in_flight_bound(stack: ApiStack) -> None:
    """80 threads with their own clients against EPD_API_MAX_IN_FLIGHT=2 (the replica): every
    one ends with a completed request or a Throttled after its retries, nothing else."""
    from frontend.client import RetryPolicy, SyncEPDClient, Throttled

    outcomes: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        policy = RetryPolicy(retries=40, base_s=0.05, max_delay_s=2.0)
        try:
            with SyncEPDClient(stack.replica.url, token="alice-token", retry=policy) as c:
                rid = c.submit(prompt=f"thread {i}", max_tokens=1)
                what = c.wait(rid, timeout_s=240).status
        except Throttled:
            what = "throttled"
        except Exception as exc:  # anything else is the defect
            what = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(what)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(80)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    print(f"\n80 THREADS: {sorted(set(outcomes))} completed={outcomes.count('completed')}")
    assert len(outcomes) == 80
    assert set(outcomes) <= {"completed", "throttled"}, outcomes
    assert outcomes.count("completed") >= 10


# ------------------------------------------------------------------------- newcomer's path


async def test_openapi_documents_the_limits_the_server_has_and_the_bearer_scheme(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    s = Settings()
    doc = (await http.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    submit = doc["paths"]["/v1/requests"]["post"]
    assert {"HTTPBearer": []} in submit["security"]
    props = submit["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert props["max_tokens"]["maximum"] == s.max_tokens_limit
    assert props["images"]["maxItems"] == s.api_max_images
    status = doc["paths"]["/v1/requests/{request_id}"]["get"]["parameters"]
    wait = next(p for p in status if p["name"] == "wait")
    assert wait["schema"]["maximum"] == s.api_max_wait_s
    refused(
        await http.get("/v1/requests/x", params={"wait": s.api_max_wait_s + 1}), 422, "request.wait"
    )
    # the documented maximum is accepted (the answer is a 404: the id is unknown)
    assert (await http.get("/v1/requests/x", params={"wait": s.api_max_wait_s})).status_code == 404


def test_the_cli_names_the_token_option_on_401_and_exits_1_for_a_missing_file(
    stack: ApiStack, tmp_path: Path
) -> None:
    env = {**os.environ, "EPD_API_TOKEN": ""}
    run = [sys.executable, "-m", "epd.cli"]
    missing = subprocess.run(
        [*run, "submit", "--image", str(tmp_path / "nope.png"), "--prompt", "<image>"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "nope.png" in missing.stderr
    no_token = subprocess.run(
        [*run, "status", "abc", "--url", stack.api.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_token.returncode == 1 and "--token" in no_token.stderr, no_token.stderr


async def test_status_wait_on_a_finished_request_shows_its_real_stage_times(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    r = await http.post(
        "/v1/requests", json={"prompt": "Done <image>", "images": [data_url(png(21))]}
    )
    rid = r.json()["request_id"]
    assert (await wait_terminal(http, rid))["status"] == "completed"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "epd.cli",
        "status",
        rid,
        "--wait",
        "--url",
        stack.api.url,
        "--token",
        "alice-token",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [ln for ln in err.decode().splitlines() if ln.strip().endswith(("queued", "completed"))]
    times = [float(ln.split("s")[0]) for ln in lines]
    print(f"\nSTATUS --wait replay: {lines}")
    assert times[0] == 0.0 and times[-1] > 0.0  # times of the stages, not of the replay


# Schemathesis with bodies nested 40-900 deep on both submit routes: the one pass over every
# route, test_schemathesis_over_every_route_finds_no_server_error_or_schema_violation in
# tests/integration/test_api.py.


# ---------------------------------------------------------------- issue 27: clients that leave


def _abort_upload(url: str, path: str, ctype: str, sent: bytes, declared: int) -> None:
    """A POST that declares ``declared`` body bytes, sends ``sent`` and closes the connection."""
    import socket
    import time

    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth()['Authorization']}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + sent)
        time.sleep(0.2)  # the route is reading the body when the client goes


def _samples(metrics: str, name: str) -> dict[str, float]:
    """``name``'s samples of a Prometheus text page, by their label text."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) :].rpartition(" ")
            out[labels] = float(value)
    return out


async def test_a_client_that_disconnects_is_no_server_error(
    stack: ApiStack, http: httpx.AsyncClient
) -> None:
    """Issue 27 (3): an upload abandoned mid-body, on every route that reads one, and a stream
    abandoned mid-answer, are the client's events: no 500 in ``/metrics``, no traceback in the
    log, an INFO line, and a count under ``epd_api_client_disconnects`` by route and phase."""
    log_start = len(stack.api.log.read_bytes())
    before = (await http.get("/metrics")).text
    uploads = [
        ("/v1/requests", "application/json", b'{"prompt": "' + b"x" * 3000),
        ("/v1/requests", "multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: "),
        ("/v1/chat/completions", "application/json", b'{"messages": [{"role": "us'),
        ("/v1/responses", "application/json", b'{"input": "hel'),
        ("/v1/vllm/generate", "application/json", b'{"token_ids": [1, 2'),
    ]
    for path, ctype, sent in uploads:
        for _ in range(3):
            await asyncio.to_thread(_abort_upload, stack.api.url, path, ctype, sent, 200_000)
    body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 500}
    body.update(stream=True, ignore_eos=True)
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # leave mid-answer
    want = {(path, "body") for path, _, _ in uploads} | {("/v1/chat/completions", "stream")}

    def gone(page: str) -> dict[tuple[str, str], float]:
        samples = _samples(page, "epd_api_client_disconnects_total")
        return {w: samples.get(f'{{phase="{w[1]}",route="{w[0]}"}}', 0.0) for w in want}

    def server_errors(page: str) -> dict[str, float]:
        samples = _samples(page, "epd_api_http_request_seconds_count")
        return {k: v for k, v in samples.items() if 'code="5' in k}

    counted: dict[tuple[str, str], float] = {}
    for _ in range(50):
        metrics = (await http.get("/metrics")).text
        counted = {w: n - gone(before)[w] for w, n in gone(metrics).items()}
        if all(counted.values()) and counted[("/v1/requests", "body")] >= 6:
            break
        await asyncio.sleep(0.2)
    assert counted[("/v1/requests", "body")] == 6, counted
    assert all(n >= 1 for n in counted.values()), counted
    assert server_errors(metrics) == server_errors(before), server_errors(metrics)
    assert 'code="499"' in metrics
    log = stack.api.log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-3000:]
    assert "client disconnected before its request was read" in log, log[-3000:]
